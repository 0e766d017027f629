//! The `mssql-cdc-flight` command line: every subcommand's flags, each with its environment
//! variable (`MSSQL_CDC_FLIGHT_<FLAG>`; the simulator's `MSSQL_CDC_SIM_<FLAG>`). Shared groups
//! (the ticket key, the workload) are defined once and flattened.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use mssql_cdc_flight::client::TLS_CA_VARIABLE;

/// Serve SQL Server change data capture as Arrow Flight streams.
#[derive(Parser)]
#[command(version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Commands,
}

#[derive(Subcommand)]
pub enum Commands {
    /// Run the Flight server.
    Serve(ServeArgs),
    /// Create and drive a simulated CDC database.
    #[command(subcommand)]
    Sim(SimCommand),
    /// Example client: read the changes of a table from a running server.
    Read(ReadArgs),
    /// The whole loop on the embedded default: a simulated database with a workload, the
    /// server on a loopback port, and the example client reading two ranges.
    Demo(DemoArgs),
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
    /// PEM certificate chain for TLS (with --tls-key); plaintext without.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

#[derive(Args)]
pub struct TicketKeyArgs {
    /// File holding the ticket signing key (64 hex digits, or at least 16 bytes of text).
    /// Replicas that share it redeem each other's tickets. Default: a random key per process.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TICKET_KEY_FILE")]
    pub ticket_key_file: Option<PathBuf>,
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
