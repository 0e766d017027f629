//! The Flight servers of the model's world, behind one address. A restart cuts every
//! connection in flight, refuses connections for a moment, and serves what follows from a
//! new server, with the same ticket key (replicas of one deployment share it) or a new one
//! (a server without a key file draws one at start, so tickets signed before it restarted
//! are refused): what a restart of the server does to the writers and the sidecar reading
//! through it.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use mssql_cdc_flight::flight::ServiceOptions;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::masking::MaskPolicy;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::sim::SimDb;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use crate::ops::Table;

/// The ticket key the servers of the world sign with, until a restart draws another.
const TICKET_KEY: &[u8] = b"the model test's shared ticket key";

/// Where connections go, and those open now.
struct Route {
    /// `None` while the server restarts: connections are refused.
    backend: Option<SocketAddr>,
    connections: Vec<JoinHandle<()>>,
}

pub(crate) struct Servers {
    /// The address every client of the world uses.
    pub(crate) url: String,
    db: SimDb,
    route: Arc<Mutex<Route>>,
    current: tokio::sync::Mutex<Option<LocalServer>>,
    accepting: JoinHandle<()>,
    /// Restarts that drew a new ticket key.
    keys: std::sync::atomic::AtomicU64,
}

impl Servers {
    pub(crate) async fn start(db: SimDb) -> Servers {
        let server = serve(&db, 0).await;
        let route = Arc::new(Mutex::new(Route {
            backend: Some(address(&server)),
            connections: Vec::new(),
        }));
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let accepting = tokio::spawn(accept(listener, route.clone()));
        Servers {
            url,
            db,
            route,
            current: tokio::sync::Mutex::new(Some(server)),
            accepting,
            keys: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Cuts every connection, refuses new ones for `down`, then serves from a new server
    /// (signing with a new ticket key when `rekey`); returns how many connections were open.
    pub(crate) async fn restart(&self, down: Duration, rekey: bool) -> usize {
        let mut current = self.current.lock().await;
        let cut: Vec<JoinHandle<()>> = {
            let mut route = lock(&self.route);
            route.backend = None;
            std::mem::take(&mut route.connections)
                .into_iter()
                .filter(|connection| !connection.is_finished())
                .collect()
        };
        for connection in &cut {
            connection.abort();
        }
        if let Some(old) = current.take() {
            // Its clients are gone: the calls it still runs end on their next write.
            if tokio::time::timeout(Duration::from_secs(30), old.stop())
                .await
                .is_err()
            {
                panic!("a restarted server did not stop within 30 s of its clients' cut");
            }
        }
        tokio::time::sleep(down).await;
        let key = match rekey {
            true => self.keys.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1,
            false => self.keys.load(std::sync::atomic::Ordering::SeqCst),
        };
        let server = serve(&self.db, key).await;
        lock(&self.route).backend = Some(address(&server));
        *current = Some(server);
        cut.len()
    }
}

impl Drop for Servers {
    fn drop(&mut self) {
        self.accepting.abort();
        for connection in lock(&self.route).connections.drain(..) {
            connection.abort();
        }
    }
}

/// The key the world's servers hash masked columns with (every restart keeps it, as a
/// deployment's secret file would).
pub(crate) const HASH_KEY: &[u8] = b"the model test's hash key for masked columns";

/// The masks every server of the world serves ([`Table::masked_columns`]).
fn masks() -> MaskPolicy {
    let tables: serde_json::Map<String, serde_json::Value> = Table::ALL
        .iter()
        .filter(|table| !table.masked_columns().is_empty())
        .map(|table| {
            let columns: serde_json::Map<String, serde_json::Value> = table
                .masked_columns()
                .iter()
                .map(|(column, mask)| (column.to_string(), serde_json::json!(mask)))
                .collect();
            (
                table.source().to_string(),
                serde_json::Value::Object(columns),
            )
        })
        .collect();
    let json = serde_json::json!({"hash_key_file": "mask.key", "tables": tables});
    MaskPolicy::parse(json.to_string().as_bytes(), |_| Ok(HASH_KEY.to_vec())).expect("masks")
}

/// A server of `db` signing with the world's `key`-th ticket key.
async fn serve(db: &SimDb, key: u64) -> LocalServer {
    let secret = [TICKET_KEY, &key.to_be_bytes()].concat();
    let signer = TicketSigner::new(&secret).expect("ticket key");
    let options = ServiceOptions {
        masks: Arc::new(masks()),
        ..ServiceOptions::new(signer)
    };
    LocalServer::start_with(Arc::new(db.clone()), options)
        .await
        .expect("server")
}

fn address(server: &LocalServer) -> SocketAddr {
    server
        .url
        .trim_start_matches("http://")
        .parse()
        .expect("a server's address")
}

fn lock(route: &Mutex<Route>) -> std::sync::MutexGuard<'_, Route> {
    route
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Forwards each connection to the server of the moment; one accepted while the server
/// restarts is closed at once (the client sees its connection refused or reset).
async fn accept(listener: TcpListener, route: Arc<Mutex<Route>>) {
    while let Ok((client, _)) = listener.accept().await {
        let mut route_now = lock(&route);
        route_now
            .connections
            .retain(|connection| !connection.is_finished());
        let Some(backend) = route_now.backend else {
            drop(client);
            continue;
        };
        route_now.connections.push(tokio::spawn(async move {
            let mut client = client;
            if let Ok(mut server) = TcpStream::connect(backend).await {
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            }
        }));
    }
}
