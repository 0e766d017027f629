//! The `mssql-cdc-flight` command line: every subcommand's flags, each with its environment
//! variable (`MSSQL_CDC_FLIGHT_<FLAG>`; the simulator's `MSSQL_CDC_SIM_<FLAG>`). Shared groups
//! (the ticket key, the workload) are defined once and flattened.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use mssql_cdc_flight::client::{TLS_CA_VARIABLE, TOKEN_VARIABLE};
use mssql_cdc_flight::flight::Limits;

/// Serve SQL Server change data capture as Arrow Flight streams.
#[derive(Parser)]
#[command(version, about)]
pub struct Cli {
    #[command(flatten)]
    pub log: mssql_cdc_proto::logging::LogArgs,
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Subcommand)]
pub enum Commands {
    /// Run the Flight server.
    Serve(Box<ServeArgs>),
    /// Create and drive a simulated CDC database.
    #[command(subcommand)]
    Sim(SimCommand),
    /// Example client: read the changes of a table from a running server.
    Read(ReadArgs),
    /// The whole loop on the embedded default: a simulated database with a workload, the
    /// server on a loopback port, and the example client reading two ranges.
    Demo(DemoArgs),
    /// Ask a running server's gRPC health service; exit 0 only when it is SERVING (the
    /// container image's HEALTHCHECK).
    Health(HealthArgs),
}

#[derive(Args)]
pub struct HealthArgs {
    /// Server address (`https://` verifies the server against --tls-ca).
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// PEM certificate of the CA that signed the server's TLS certificate.
    #[arg(long, env = TLS_CA_VARIABLE)]
    pub tls_ca: Option<PathBuf>,
    /// Seconds to wait for the answer.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_HEALTH_TIMEOUT", default_value_t = 5.0)]
    pub timeout: f64,
    /// The service whose health to ask: the Flight service by default; `""` for a
    /// writer sidecar's admin service (SERVING while every table streams).
    #[arg(
        long,
        default_value = "arrow.flight.protocol.FlightService",
        env = "MSSQL_CDC_FLIGHT_HEALTH_SERVICE"
    )]
    pub service: String,
}

#[derive(Args)]
pub struct ServeArgs {
    /// The CDC source: `sim:<DIR>` (a simulated database directory), a SQL Server as
    /// `mssql://user:password@host:port/database?options` or an ADO.NET connection string
    /// (docs/sqlserver.md). Prefer --source-file or the variable for secrets.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_SOURCE",
        hide_env_values = true,
        required_unless_present = "source_file",
        conflicts_with = "source_file"
    )]
    pub source: Option<String>,
    /// A file holding the source text (first line), so no password is on a command line.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_SOURCE_FILE")]
    pub source_file: Option<PathBuf>,
    /// Address to listen on; port 0 picks a free port (the chosen address is printed).
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: String,
    #[command(flatten)]
    pub key: TicketKeyArgs,
    /// PEM certificate chain for TLS (with --tls-key); plaintext without, which only a
    /// loopback address or --insecure-no-tls allows.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Mutual TLS: PEM certificate of the CA that signs client certificates. Every client
    /// must present one; its principal is the tokens file entry with its SHA-256.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_TLS_CLIENT_CA",
        requires = "tls_cert",
        requires = "tokens_file"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// The principals (JSON: name, tables, token_sha256 and/or certificate_sha256;
    /// docs/security.md). Without it every caller reads every table.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,
    /// Columns served masked (JSON: per table, column → "hash", "truncate(n)" or "null",
    /// and the hash key file; docs/security.md). Every caller gets them masked but a
    /// principal whose `clear` grant names the table.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MASKS")]
    pub masks: Option<PathBuf>,
    /// Serve a non-loopback address without authentication (anyone who reaches the port
    /// reads every table). Refused without this flag.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_INSECURE_NO_AUTH")]
    pub insecure_no_auth: bool,
    /// Serve a non-loopback address without TLS (tokens and rows cross the network in
    /// cleartext: only where something else encrypts the path, a mesh's mutual TLS say).
    /// Refused without this flag or --tls-cert.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_INSECURE_NO_TLS")]
    pub insecure_no_tls: bool,
    /// Serve Prometheus metrics at http://ADDR/metrics (docs/operations.md); none without.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_METRICS_LISTEN")]
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Seconds between the live tail's `max_lsn` reads while `wait_for_commits` calls wait
    /// (one read serves every waiting call; none while no call waits).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TAIL_INTERVAL", default_value_t = 0.1)]
    pub tail_interval: f64,
    #[command(flatten)]
    pub limits: LimitArgs,
}

#[derive(Args)]
pub struct TicketKeyArgs {
    /// File of ticket signing keys: one per line (64 hex digits, or at least 16 bytes of
    /// text), the first signs and all verify, so a key rotates without breaking plans in
    /// flight; a file that is not UTF-8 is one binary key. Replicas that share it redeem each
    /// other's tickets. Default: a random key per process.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TICKET_KEY_FILE")]
    pub ticket_key_file: Option<PathBuf>,
    /// Hours a ticket stays redeemable; an expired one is FAILED_PRECONDITION ("re-plan").
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TICKET_HOURS", default_value_t = 24.0)]
    pub ticket_hours: f64,
}

/// The bounds of what clients control (docs/security.md, "Limits").
#[derive(Args)]
pub struct LimitArgs {
    /// Most rows a client may ask per batch.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_BATCH_ROWS", default_value_t = Limits::default().max_batch_rows)]
    pub max_batch_rows: usize,
    /// Most bytes a client may ask per batch (the default keeps messages under the 4 MiB
    /// limit of stock gRPC clients for rows under 1 MiB).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_BATCH_BYTES", default_value_t = Limits::default().max_batch_bytes)]
    pub max_batch_bytes: usize,
    /// Most chunks of one snapshot request (one ticket each).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_CHUNKS", default_value_t = Limits::default().max_chunks)]
    pub max_chunks: usize,
    /// Most rows a key_bound seek may skip (n).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_SEEK_ROWS", default_value_t = Limits::default().max_seek_rows)]
    pub max_seek_rows: u64,
    /// Most do_get streams open at once; more are RESOURCE_EXHAUSTED with a retry hint.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_STREAMS", default_value_t = Limits::default().max_streams)]
    pub max_streams: usize,
    /// Most do_get streams open at once for one principal.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_STREAMS_PER_PRINCIPAL", default_value_t = Limits::default().max_streams_per_principal)]
    pub max_streams_per_principal: usize,
    /// Most planning calls (list, plan, schema, action) running at once for one principal.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_CALLS_PER_PRINCIPAL", default_value_t = Limits::default().max_calls_per_principal)]
    pub max_calls_per_principal: usize,
    /// Most connections open at once from one address (before TLS or credentials); one
    /// more is closed as soon as it is accepted.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_CONNECTIONS_PER_PEER", default_value_t = Limits::default().max_connections_per_peer)]
    pub max_connections_per_peer: usize,
    /// Most connections open at once from everyone.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_CONNECTIONS", default_value_t = Limits::default().max_connections)]
    pub max_connections: usize,
    /// Most calls (HTTP/2 streams) open at once on one connection; the peer is told in the
    /// connection's settings and one more is refused.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_STREAMS_PER_CONNECTION", default_value_t = Limits::default().max_streams_per_connection)]
    pub max_streams_per_connection: u32,
    /// With a tokens file: seconds a connection may stay open before one of its calls
    /// presents valid credentials; then it is closed.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_UNAUTHENTICATED_TIMEOUT", default_value_t = Limits::default().unauthenticated_timeout.as_secs_f64())]
    pub unauthenticated_timeout: f64,
    /// With a tokens file: connections open at once from one address before any of their
    /// calls presented valid credentials; one more is closed as soon as it is accepted.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_UNAUTHENTICATED_PER_PEER", default_value_t = Limits::default().max_unauthenticated_per_peer)]
    pub max_unauthenticated_per_peer: usize,
    /// Bytes all open do_get streams may hold together on their way to clients; each
    /// stream's batches are cut to its share, so many slow readers get smaller batches, not
    /// more memory (docs/operations.md, "Memory").
    #[arg(long, env = "MSSQL_CDC_FLIGHT_STREAM_MEMORY", default_value_t = Limits::default().stream_memory)]
    pub stream_memory: usize,
    /// Seconds a planning call (list, plan, schema, action) may take: DEADLINE_EXCEEDED after.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_CALL_TIMEOUT", default_value_t = Limits::default().call_timeout.as_secs_f64())]
    pub call_timeout: f64,
    /// Largest request message accepted, in bytes.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_REQUEST_BYTES", default_value_t = Limits::default().max_request_bytes)]
    pub max_request_bytes: usize,
    /// Seconds between HTTP/2 keepalive pings; a peer silent for --keepalive-timeout more is
    /// dropped with its streams.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_KEEPALIVE_INTERVAL", default_value_t = Limits::default().keepalive_interval.as_secs_f64())]
    pub keepalive_interval: f64,
    /// Seconds a keepalive ping may go unanswered.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_KEEPALIVE_TIMEOUT", default_value_t = Limits::default().keepalive_timeout.as_secs_f64())]
    pub keepalive_timeout: f64,
    /// Seconds a do_get stream may wait for its client to take a batch; then it ends
    /// (STREAM_STALLED) and its source read and connection are released (0: no limit; keep
    /// it longer than any chunk the writer drains, docs/security.md).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_STALL_TIMEOUT", default_value_t = Limits::default().stall_timeout.map_or(0.0, |timeout| timeout.as_secs_f64()))]
    pub stall_timeout: f64,
    /// Source reads (streams and planning calls) one principal may run at once, so that no
    /// principal holds every pooled connection (default: the SQL Server pool's size less
    /// one; 0: no bound).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_SOURCE_SHARE")]
    pub source_share: Option<usize>,
}

#[derive(Subcommand)]
pub enum SimCommand {
    /// Create a database with the sample tables (dbo.customers, dbo.orders), CDC enabled,
    /// and seeded rows inserted as captured transactions.
    Init(SimInitArgs),
    /// Apply a seeded OLTP workload (while a server may be serving the directory).
    Run(SimRunArgs),
    /// Retention cleanup: remove change rows below a low water mark, moving min_lsn.
    Cleanup(SimCleanupArgs),
    /// ALTER TABLE ... ADD a column (recorded in the DDL history).
    AddColumn(SimAddColumnArgs),
    /// Enable a second capture instance on a table (from the next commit on).
    EnableCaptureInstance(SimEnableArgs),
    /// Print the catalog and positions.
    Info {
        /// The database directory.
        dir: PathBuf,
    },
}

#[derive(Args)]
pub struct SimInitArgs {
    /// Directory to create.
    pub dir: PathBuf,
    /// Customers to insert.
    #[arg(long, default_value_t = 500, env = "MSSQL_CDC_SIM_CUSTOMERS")]
    pub customers: usize,
    /// Orders to insert.
    #[arg(long, default_value_t = 2000, env = "MSSQL_CDC_SIM_ORDERS")]
    pub orders: usize,
    /// Seed of the generated values.
    #[arg(long, default_value_t = 1, env = "MSSQL_CDC_SIM_SEED")]
    pub seed: u64,
    /// Also create the 60-column benchmark table dbo.wide (empty).
    #[arg(long, env = "MSSQL_CDC_SIM_WIDE")]
    pub wide: bool,
    /// Also create dbo.types, one column of each type the simulator serves, with this many
    /// rows.
    #[arg(long, env = "MSSQL_CDC_SIM_TYPES")]
    pub types: Option<usize>,
}

#[derive(Args)]
pub struct WorkloadArgs {
    /// Transactions and idle entries to write.
    #[arg(long, default_value_t = 1000, env = "MSSQL_CDC_SIM_COMMITS")]
    pub commits: u64,
    /// Stop after this many seconds (with --commits, whichever comes first).
    #[arg(long, env = "MSSQL_CDC_SIM_DURATION")]
    pub duration: Option<f64>,
    /// Commits per second (default: as fast as possible).
    #[arg(long, env = "MSSQL_CDC_SIM_RATE")]
    pub rate: Option<f64>,
    /// Weights of the kinds of work: insert, update, delete, key_update, idle.
    #[arg(
        long,
        default_value = "insert=0.45,update=0.35,delete=0.12,key_update=0.03,idle=0.05"
    )]
    pub mix: String,
    /// Statements per transaction, at most.
    #[arg(long, default_value_t = 4, env = "MSSQL_CDC_SIM_MAX_STATEMENTS")]
    pub max_statements: u32,
    /// Rows per statement, at most.
    #[arg(
        long,
        default_value_t = 3,
        env = "MSSQL_CDC_SIM_MAX_ROWS_PER_STATEMENT"
    )]
    pub max_rows_per_statement: u32,
    /// Only these tables (schema.table, repeatable).
    #[arg(long = "table", env = "MSSQL_CDC_SIM_TABLE")]
    pub tables: Vec<String>,
}

#[derive(Args)]
pub struct SimRunArgs {
    /// The database directory.
    pub dir: PathBuf,
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// Seed of the workload (same seed on the same database: same changes).
    #[arg(long, default_value_t = 1, env = "MSSQL_CDC_SIM_SEED")]
    pub seed: u64,
    /// Append every change row to this JSON-lines file (a test oracle).
    #[arg(long, env = "MSSQL_CDC_SIM_JOURNAL")]
    pub journal: Option<PathBuf>,
    /// Commit times from the machine clock (`wall`) or 1 ms apart (`virtual`).
    #[arg(long, default_value = "wall", env = "MSSQL_CDC_SIM_CLOCK")]
    pub clock: String,
}

#[derive(Args)]
pub struct SimCleanupArgs {
    /// The database directory.
    pub dir: PathBuf,
    /// The new low water mark (an LSN); rows below it are removed.
    #[arg(long, env = "MSSQL_CDC_SIM_LOW_WATER_MARK")]
    pub low_water_mark: String,
    /// Only this capture instance (default: all).
    #[arg(long, env = "MSSQL_CDC_SIM_CAPTURE_INSTANCE")]
    pub capture_instance: Option<String>,
}

#[derive(Args)]
pub struct SimAddColumnArgs {
    /// The database directory.
    pub dir: PathBuf,
    /// The table (schema.table).
    #[arg(long, env = "MSSQL_CDC_SIM_TABLE")]
    pub table: String,
    /// The new column's name.
    #[arg(long, env = "MSSQL_CDC_SIM_COLUMN")]
    pub column: String,
    /// Its SQL Server type, e.g. decimal(9,2).
    #[arg(long = "type", env = "MSSQL_CDC_SIM_TYPE")]
    pub sql_type: String,
    /// Make it NOT NULL (default: NULL).
    #[arg(long, env = "MSSQL_CDC_SIM_NOT_NULL")]
    pub not_null: bool,
}

#[derive(Args)]
pub struct SimEnableArgs {
    /// The database directory.
    pub dir: PathBuf,
    /// The table (schema.table).
    #[arg(long, env = "MSSQL_CDC_SIM_TABLE")]
    pub table: String,
    /// The capture instance name, e.g. dbo_orders_v2.
    #[arg(long, env = "MSSQL_CDC_SIM_NAME")]
    pub name: String,
    /// Columns to capture (comma-separated; default: every column of the table now).
    #[arg(long, value_delimiter = ',', env = "MSSQL_CDC_SIM_COLUMNS")]
    pub columns: Vec<String>,
}

#[derive(Args)]
pub struct ReadArgs {
    /// Server address.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    pub server: String,
    /// Table to read (schema.table).
    #[arg(long, default_value = "dbo.orders", env = "MSSQL_CDC_FLIGHT_TABLE")]
    pub table: String,
    /// Start after this offset: `earliest`, `latest`, or an LSN already processed.
    #[arg(long, default_value = "earliest", env = "MSSQL_CDC_FLIGHT_FROM")]
    pub from: String,
    /// Read at most this many commits (default: up to max_lsn).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_MAX_COMMITS")]
    pub max_commits: Option<u64>,
    /// Partitions (endpoints read in parallel).
    #[arg(long, default_value_t = 4, env = "MSSQL_CDC_FLIGHT_PARTITIONS")]
    pub partitions: u32,
    /// Print this many rows of the first batch.
    #[arg(long, default_value_t = 5, env = "MSSQL_CDC_FLIGHT_SHOW")]
    pub show: usize,
    /// PEM certificate of the CA that signed the server's TLS certificate (use https://).
    #[arg(long, env = TLS_CA_VARIABLE)]
    pub tls_ca: Option<PathBuf>,
    /// Bearer token of a principal of the server's tokens file.
    #[arg(long, env = TOKEN_VARIABLE, hide_env_values = true)]
    pub token: Option<String>,
}

#[derive(Args)]
pub struct DemoArgs {
    /// Keep the simulated database here (default: a temporary directory).
    #[arg(long, env = "MSSQL_CDC_FLIGHT_DIR")]
    pub dir: Option<PathBuf>,
    /// Commits of the workload before each read.
    #[arg(long, default_value_t = 2000, env = "MSSQL_CDC_FLIGHT_COMMITS")]
    pub commits: u64,
}
