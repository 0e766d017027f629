//! The peer of the throughput bench: a stock arrow-flight server serving batches from memory.
//!
//! It is what a user would write with arrow-rs alone: a `FlightService` whose `do_get` hands
//! record batches held in memory to `FlightDataEncoderBuilder` with its defaults, on a
//! default tonic server. It runs in its own process (the bench binary started again with
//! `stock-server DIR TABLE`), as our server does, so the two compete for the same two cores
//! in the same way. Its batches are the simulator's output batches of the whole range, copied
//! into buffers of their own, as a user's batches in memory would be. A ticket `i/n` names the
//! `i`-th of `n` contiguous shares of them, so one and two endpoints read the same rows as our
//! plans do.

use std::sync::Arc;

use arrow::compute::concat_batches;
use arrow::record_batch::RecordBatch;
use arrow_flight::encode::FlightDataEncoderBuilder;
use arrow_flight::flight_service_server::{FlightService, FlightServiceServer};
use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaResult, Ticket,
};
use futures::stream::{BoxStream, StreamExt, TryStreamExt};
use tonic::{Request, Response, Status, Streaming};

type Answer<T> = Result<Response<BoxStream<'static, Result<T, Status>>>, Status>;

/// Batches in memory, served in `n` contiguous shares.
struct StockService {
    batches: Arc<Vec<RecordBatch>>,
}

/// The share of `count` batches that ticket `i/n` names.
fn share(ticket: &[u8], count: usize) -> Result<std::ops::Range<usize>, Status> {
    let text = std::str::from_utf8(ticket).map_err(|_| Status::invalid_argument("ticket"))?;
    let (index, shares) = text
        .split_once('/')
        .and_then(|(i, n)| Some((i.parse::<usize>().ok()?, n.parse::<usize>().ok()?)))
        .filter(|(i, n)| i < n)
        .ok_or_else(|| Status::invalid_argument("a ticket is i/n"))?;
    Ok(index * count / shares..(index + 1) * count / shares)
}

#[tonic::async_trait]
impl FlightService for StockService {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoPutStream = BoxStream<'static, Result<PutResult, Status>>;
    type DoActionStream = BoxStream<'static, Result<arrow_flight::Result, Status>>;
    type ListActionsStream = BoxStream<'static, Result<ActionType, Status>>;
    type DoExchangeStream = BoxStream<'static, Result<FlightData, Status>>;

    async fn do_get(&self, request: Request<Ticket>) -> Answer<FlightData> {
        let range = share(&request.get_ref().ticket, self.batches.len())?;
        let batches = Arc::clone(&self.batches);
        let stream = futures::stream::iter(range).map(move |index| Ok(batches[index].clone()));
        Ok(Response::new(
            FlightDataEncoderBuilder::new()
                .build(stream)
                .map_err(Status::from)
                .boxed(),
        ))
    }

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Answer<HandshakeResponse> {
        Err(Status::unimplemented("handshake"))
    }
    async fn list_flights(&self, _: Request<Criteria>) -> Answer<FlightInfo> {
        Err(Status::unimplemented("list_flights"))
    }
    async fn get_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        Err(Status::unimplemented("get_flight_info"))
    }
    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        Err(Status::unimplemented("poll_flight_info"))
    }
    async fn get_schema(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        Err(Status::unimplemented("get_schema"))
    }
    async fn do_put(&self, _: Request<Streaming<FlightData>>) -> Answer<PutResult> {
        Err(Status::unimplemented("do_put"))
    }
    async fn do_action(&self, _: Request<Action>) -> Answer<arrow_flight::Result> {
        Err(Status::unimplemented("do_action"))
    }
    async fn list_actions(&self, _: Request<Empty>) -> Answer<ActionType> {
        Err(Status::unimplemented("list_actions"))
    }
    async fn do_exchange(&self, _: Request<Streaming<FlightData>>) -> Answer<FlightData> {
        Err(Status::unimplemented("do_exchange"))
    }
}

/// Serves `batches` (each copied into buffers of its own) on `127.0.0.1:0` until killed,
/// after printing `listening on ADDRESS`.
pub async fn serve(batches: Vec<RecordBatch>) -> anyhow::Result<()> {
    let owned = batches
        .iter()
        .map(|batch| concat_batches(&batch.schema(), [batch]))
        .collect::<Result<Vec<_>, _>>()?;
    drop(batches);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("listening on {}", listener.local_addr()?);
    let service = StockService {
        batches: Arc::new(owned),
    };
    tonic::transport::Server::builder()
        .add_service(FlightServiceServer::new(service))
        // TCP_NODELAY as tonic sets it on a listener it binds itself (`Server::serve`).
        .serve_with_incoming(
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
        )
        .await?;
    Ok(())
}
