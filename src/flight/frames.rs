//! `DoGet` responses written as gRPC frames without copying the batches' bodies.
//!
//! tonic's codec encodes every response message into its own buffer before hyper sends it, so
//! each Arrow body, already encoded once into IPC, is copied once more in user space: about a
//! fifth of the server's CPU while streaming (the profile in docs/design-notes.md, "Serving").
//! Here a message becomes HTTP/2 data chunks instead: a small head (the gRPC message prefix,
//! the protobuf fields other than `data_body`, and `data_body`'s key and length), then the
//! body's pieces themselves, the batch's own buffers where [`super::encode`] left them so,
//! which h2 hands to the socket by vectored writes. The bytes on the wire are those of tonic's
//! encoding, field for field, so every gRPC client reads them as before; errors end the
//! stream in trailers, as tonic's do.
//!
//! [`ZeroCopyDoGet`] wraps the generated server and answers only the `DoGet` path; it sits
//! inside the authentication interceptor, so the caller's principal is already in the
//! request's extensions, and it opens the stream as [`FlightService::do_get`] does
//! ([`CdcFlightService::open_get`]).

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use arrow_flight::Ticket;
use bytes::{BufMut, Bytes, BytesMut};
use futures::StreamExt;
use futures::future::BoxFuture;
use http_body::Frame;
use http_body_util::{BodyExt, Limited};
use prost::Message;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint, key_len};
use tonic::Status;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::server::NamedService;

use super::CdcFlightService;
use super::encode::Message as StreamMessage;
use super::stream::BoxedStream;

/// The gRPC path this wrapper answers.
const DO_GET_PATH: &str = "/arrow.flight.protocol.FlightService/DoGet";

/// `FlightData.data_body`'s field number.
const DATA_BODY_FIELD: u32 = 1000;

/// The gRPC message prefix: a compression flag and the message's length.
const PREFIX_BYTES: usize = 5;

/// The generated Flight server with `DoGet` answered by [`do_get`].
#[derive(Clone)]
pub struct ZeroCopyDoGet<S> {
    inner: S,
    service: Arc<CdcFlightService>,
    max_request_bytes: usize,
}

impl<S> ZeroCopyDoGet<S> {
    /// Serves `DoGet` of `service` (the one `inner` serves) itself; requests over
    /// `max_request_bytes` are refused as tonic refuses them.
    pub fn new(inner: S, service: Arc<CdcFlightService>, max_request_bytes: usize) -> Self {
        ZeroCopyDoGet {
            inner,
            service,
            max_request_bytes,
        }
    }
}

impl<S: NamedService> NamedService for ZeroCopyDoGet<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<http::Request<Body>> for ZeroCopyDoGet<S>
where
    S: tonic::codegen::Service<
            http::Request<Body>,
            Response = http::Response<Body>,
            Error = Infallible,
        >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<http::Response<Body>, Infallible>>;

    fn poll_ready(&mut self, context: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(context)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        if request.uri().path() != DO_GET_PATH {
            return Box::pin(self.inner.call(request));
        }
        let service = Arc::clone(&self.service);
        let max_request_bytes = self.max_request_bytes;
        Box::pin(async move {
            Ok(match do_get(&service, request, max_request_bytes).await {
                Ok(response) => response,
                Err(status) => status.into_http(),
            })
        })
    }
}

/// Decodes the ticket, opens its stream and answers with it as [`FlightDataBody`].
async fn do_get(
    service: &CdcFlightService,
    request: http::Request<Body>,
    max_request_bytes: usize,
) -> Result<http::Response<Body>, Status> {
    let (parts, body) = request.into_parts();
    let bytes = Limited::new(body, max_request_bytes.saturating_add(PREFIX_BYTES))
        .collect()
        .await
        // OUT_OF_RANGE, as tonic's own size check answers every other call.
        .map_err(|error| {
            Status::out_of_range(format!(
                "the DoGet request could not be read within {max_request_bytes} bytes: {error}"
            ))
        })?
        .to_bytes();
    let ticket = Ticket::decode(unary_message(&bytes)?)
        .map_err(|error| Status::invalid_argument(format!("the ticket is malformed: {error}")))?;
    let (metadata, extensions, ()) =
        tonic::Request::from_http(http::Request::from_parts(parts, ())).into_parts();
    let response = service
        .open_get(tonic::Request::from_parts(metadata, extensions, ticket))
        .await?;
    let (metadata, stream, _) = response.into_parts();
    let mut answer = http::Response::new(Body::new(FlightDataBody::new(stream)));
    *answer.headers_mut() = metadata.into_headers();
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    Ok(answer)
}

/// The one message of a unary gRPC request body.
fn unary_message(bytes: &[u8]) -> Result<&[u8], Status> {
    let (prefix, message) = bytes
        .split_at_checked(PREFIX_BYTES)
        .ok_or_else(|| Status::invalid_argument("the DoGet request holds no message"))?;
    if prefix[0] != 0 {
        return Err(Status::unimplemented(
            "this server does not accept compressed requests",
        ));
    }
    let length = u32::from_be_bytes([prefix[1], prefix[2], prefix[3], prefix[4]]) as usize;
    if message.len() != length {
        return Err(Status::invalid_argument(format!(
            "the DoGet request's message says {length} bytes but {} arrived",
            message.len()
        )));
    }
    Ok(message)
}

/// A `DoGet` response body: each message's head, then its body's pieces, then the status
/// trailers.
pub struct FlightDataBody {
    stream: BoxedStream<StreamMessage>,
    /// The body pieces still to go of the message whose head went last.
    body: std::vec::IntoIter<Bytes>,
    /// Whether the trailers went.
    ended: bool,
}

impl FlightDataBody {
    /// The body of `stream`.
    pub fn new(stream: BoxedStream<StreamMessage>) -> Self {
        FlightDataBody {
            stream,
            body: Vec::new().into_iter(),
            ended: false,
        }
    }
}

impl http_body::Body for FlightDataBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = self.get_mut();
        if let Some(piece) = this.body.next() {
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        if this.ended {
            return Poll::Ready(None);
        }
        let status = match ready!(this.stream.poll_next_unpin(context)) {
            Some(Ok(message)) => match message_head(&message) {
                Ok(head) => {
                    this.body = message.body.into_iter();
                    return Poll::Ready(Some(Ok(Frame::data(head))));
                }
                Err(status) => status,
            },
            Some(Err(status)) => status,
            None => Status::ok(""),
        };
        this.ended = true;
        let mut trailers = http::HeaderMap::new();
        status.add_header(&mut trailers)?;
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        // A body is never pending once the trailers went.
        self.ended
    }
}

/// The head of `message`: what goes before its body's pieces, so that head and pieces
/// together are the gRPC message as prost encodes it behind the gRPC prefix.
pub fn message_head(message: &StreamMessage) -> Result<Bytes, Status> {
    let data = &message.data;
    if !data.data_body.is_empty() {
        return Err(Status::internal(
            "a message's body travels in its pieces, not in data_body (a server bug)",
        ));
    }
    let body = message.body_len();
    let body_field = if body == 0 {
        0
    } else {
        key_len(DATA_BODY_FIELD) + encoded_len_varint(body as u64)
    };
    let head_length = data.encoded_len() + body_field;
    let message_length = head_length + body;
    let length = u32::try_from(message_length).map_err(|_| {
        Status::internal(format!(
            "a message of {message_length} bytes exceeds gRPC's 4 GiB"
        ))
    })?;
    let mut head = BytesMut::with_capacity(PREFIX_BYTES + head_length);
    head.put_u8(0);
    head.put_u32(length);
    data.encode(&mut head)
        .map_err(|error| Status::internal(format!("encoding a message's head: {error}")))?;
    if body > 0 {
        encode_key(DATA_BODY_FIELD, WireType::LengthDelimited, &mut head);
        encode_varint(body as u64, &mut head);
    }
    Ok(head.freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    use arrow_flight::FlightData;

    /// A message whose body is `pieces`.
    fn sample(pieces: &[&'static [u8]], metadata: &'static [u8]) -> StreamMessage {
        StreamMessage {
            data: FlightData {
                flight_descriptor: None,
                data_header: Bytes::from_static(b"an IPC message header"),
                app_metadata: Bytes::from_static(metadata),
                data_body: Bytes::new(),
            },
            body: pieces
                .iter()
                .map(|piece| Bytes::from_static(piece))
                .collect(),
        }
    }

    /// The head and the pieces together are tonic's own frame of the message: the 5-byte
    /// prefix, then prost's encoding, which decodes back to the same `FlightData`.
    #[test]
    fn head_and_pieces_are_the_message_as_tonic_frames_it() {
        let large = vec![7u8; 300_000].leak();
        for message in [
            sample(&[], b""),
            sample(&[b"a body"], b""),
            sample(&[], b"{\"type\":\"completion\"}"),
            sample(&[large], b"metadata"),
            sample(
                &[b"a head piece", large, b"", b"padding", large],
                b"metadata",
            ),
        ] {
            let head = message_head(&message).expect("head");
            let mut wire = head.to_vec();
            for piece in &message.body {
                wire.extend_from_slice(piece);
            }
            let data = message.clone().into_flight_data();
            let expected = data.encode_to_vec();
            assert_eq!(wire[0], 0, "uncompressed");
            assert_eq!(&wire[1..5], &(expected.len() as u32).to_be_bytes());
            assert_eq!(wire[5..], expected[..], "prost's bytes, field for field");
            assert_eq!(
                FlightData::decode(&wire[5..]).expect("decodes"),
                data,
                "the message decodes back"
            );
        }
    }

    #[test]
    fn a_body_in_data_body_is_refused_rather_than_sent_twice() {
        let mut message = sample(&[b"a piece"], b"");
        message.data.data_body = Bytes::from_static(b"a body");
        assert_eq!(
            message_head(&message).expect_err("refused").code(),
            tonic::Code::Internal
        );
    }

    #[test]
    fn a_request_message_is_checked_against_its_prefix() {
        let ticket = Ticket::new("t").encode_to_vec();
        let mut request = vec![0, 0, 0, 0, ticket.len() as u8];
        request.extend_from_slice(&ticket);
        assert_eq!(unary_message(&request).expect("whole"), &ticket[..]);
        assert!(unary_message(&request[..request.len() - 1]).is_err());
        assert!(unary_message(&request[..3]).is_err());
        request[0] = 1;
        assert_eq!(
            unary_message(&request).expect_err("compressed").code(),
            tonic::Code::Unimplemented
        );
    }
}
