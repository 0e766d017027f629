//! The `mssql-cdc-flight` command: the Flight server, the simulated CDC database's tools, and
//! an example client.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use mssql_cdc_flight::client::{CdcClient, ClientTls, TLS_CA_VARIABLE};
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::flight::{self, TlsIdentity};
use mssql_cdc_flight::mssql::{SqlServerConfig, SqlServerSource};
use mssql_cdc_flight::protocol::{ChangesCommand, InitialOffsetBody, LatestOffsetBody};
use mssql_cdc_flight::sim::workload::{Mix, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_flight::source::{CdcSource, TableName};
use mssql_cdc_flight::{CommitTime, Lsn, Offset};

// Streams allocate and free multi-megabyte Arrow and IPC buffers per batch; glibc hands
// those to mmap/munmap each time (page faults, zeroed pages), mimalloc reuses them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Serve SQL Server change data capture as Arrow Flight streams.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Commands,
}

#[derive(Subcommand)]
enum Commands {
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
struct ServeArgs {
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
    source: Option<String>,
    /// A file holding the source text (first line), so no password is on a command line.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_SOURCE_FILE")]
    source_file: Option<PathBuf>,
    /// Address to listen on; port 0 picks a free port (the chosen address is printed).
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    listen: String,
    #[command(flatten)]
    key: TicketKeyArgs,
    /// PEM certificate chain for TLS (with --tls-key); plaintext without.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[derive(Args)]
struct TicketKeyArgs {
    /// File holding the ticket signing key (64 hex digits, or at least 16 bytes of text).
    /// Replicas that share it redeem each other's tickets. Default: a random key per process.
    #[arg(long, env = "MSSQL_CDC_FLIGHT_TICKET_KEY_FILE")]
    ticket_key_file: Option<PathBuf>,
}

impl TicketKeyArgs {
    fn signer(&self) -> anyhow::Result<TicketSigner> {
        let Some(path) = &self.ticket_key_file else {
            tracing::warn!(
                "no ticket key file: using a random key, so only this process redeems its tickets"
            );
            return Ok(TicketSigner::random()?);
        };
        let text = std::fs::read(path)
            .with_context(|| format!("reading ticket key {}", path.display()))?;
        let trimmed = String::from_utf8_lossy(&text).trim().to_string();
        let secret = match hex::decode(&trimmed) {
            Ok(bytes) if trimmed.len() == 64 => bytes,
            _ => trimmed.into_bytes(),
        };
        Ok(TicketSigner::new(&secret)?)
    }
}

#[derive(Subcommand)]
enum SimCommand {
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
struct SimInitArgs {
    /// Directory to create.
    dir: PathBuf,
    /// Customers to insert.
    #[arg(long, default_value_t = 500)]
    customers: usize,
    /// Orders to insert.
    #[arg(long, default_value_t = 2000)]
    orders: usize,
    /// Seed of the generated values.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also create the 60-column benchmark table dbo.wide (empty).
    #[arg(long)]
    wide: bool,
}

#[derive(Args)]
struct WorkloadArgs {
    /// Transactions and idle entries to write.
    #[arg(long, default_value_t = 1000)]
    commits: u64,
    /// Stop after this many seconds (with --commits, whichever comes first).
    #[arg(long)]
    duration: Option<f64>,
    /// Commits per second (default: as fast as possible).
    #[arg(long)]
    rate: Option<f64>,
    /// Weights of the kinds of work: insert, update, delete, key_update, idle.
    #[arg(
        long,
        default_value = "insert=0.45,update=0.35,delete=0.12,key_update=0.03,idle=0.05"
    )]
    mix: String,
    /// Statements per transaction, at most.
    #[arg(long, default_value_t = 4)]
    max_statements: u32,
    /// Rows per statement, at most.
    #[arg(long, default_value_t = 3)]
    max_rows_per_statement: u32,
    /// Only these tables (schema.table, repeatable).
    #[arg(long = "table")]
    tables: Vec<String>,
}

impl WorkloadArgs {
    fn spec(&self) -> anyhow::Result<WorkloadSpec> {
        let mut tables = Vec::new();
        for table in &self.tables {
            tables.push(table.parse::<TableName>()?);
        }
        Ok(WorkloadSpec {
            commits: Some(self.commits),
            duration: self.duration.map(Duration::from_secs_f64),
            rate: self.rate,
            mix: self.mix.parse::<Mix>()?,
            max_statements: self.max_statements,
            max_rows_per_statement: self.max_rows_per_statement,
            tables,
            publish_interval: Duration::from_millis(500),
        })
    }
}

#[derive(Args)]
struct SimRunArgs {
    /// The database directory.
    dir: PathBuf,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Seed of the workload (same seed on the same database: same changes).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Append every change row to this JSON-lines file (a test oracle).
    #[arg(long)]
    journal: Option<PathBuf>,
    /// Commit times from the machine clock (`wall`) or 1 ms apart (`virtual`).
    #[arg(long, default_value = "wall")]
    clock: String,
}

#[derive(Args)]
struct SimCleanupArgs {
    /// The database directory.
    dir: PathBuf,
    /// The new low water mark (an LSN); rows below it are removed.
    #[arg(long)]
    low_water_mark: String,
    /// Only this capture instance (default: all).
    #[arg(long)]
    capture_instance: Option<String>,
}

#[derive(Args)]
struct SimAddColumnArgs {
    /// The database directory.
    dir: PathBuf,
    /// The table (schema.table).
    #[arg(long)]
    table: String,
    /// The new column's name.
    #[arg(long)]
    column: String,
    /// Its SQL Server type, e.g. decimal(9,2).
    #[arg(long = "type")]
    sql_type: String,
    /// Make it NOT NULL (default: NULL).
    #[arg(long)]
    not_null: bool,
}

#[derive(Args)]
struct SimEnableArgs {
    /// The database directory.
    dir: PathBuf,
    /// The table (schema.table).
    #[arg(long)]
    table: String,
    /// The capture instance name, e.g. dbo_orders_v2.
    #[arg(long)]
    name: String,
    /// Columns to capture (comma-separated; default: every column of the table now).
    #[arg(long, value_delimiter = ',')]
    columns: Vec<String>,
}

#[derive(Args)]
struct ReadArgs {
    /// Server address.
    #[arg(
        long,
        env = "MSSQL_CDC_FLIGHT_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    server: String,
    /// Table to read (schema.table).
    #[arg(long, default_value = "dbo.orders")]
    table: String,
    /// Start after this offset: `earliest`, `latest`, or an LSN already processed.
    #[arg(long, default_value = "earliest")]
    from: String,
    /// Read at most this many commits (default: up to max_lsn).
    #[arg(long)]
    max_commits: Option<u64>,
    /// Partitions (endpoints read in parallel).
    #[arg(long, default_value_t = 4)]
    partitions: u32,
    /// Print this many rows of the first batch.
    #[arg(long, default_value_t = 5)]
    show: usize,
    /// PEM certificate of the CA that signed the server's TLS certificate (use https://).
    #[arg(long, env = TLS_CA_VARIABLE)]
    tls_ca: Option<PathBuf>,
}

#[derive(Args)]
struct DemoArgs {
    /// Keep the simulated database here (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Commits of the workload before each read.
    #[arg(long, default_value_t = 2000)]
    commits: u64,
}

fn main() -> anyhow::Result<()> {
    mssql_cdc_flight::init_process("info");
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Commands::Serve(args) => runtime.block_on(serve(args)),
        Commands::Sim(command) => sim(command),
        Commands::Read(args) => runtime.block_on(async {
            let tls = match &args.tls_ca {
                Some(path) => Some(
                    ClientTls::from_ca_file(path)
                        .with_context(|| format!("reading {}", path.display()))?,
                ),
                None => None,
            };
            let client = CdcClient::connect_with(&args.server, tls.as_ref()).await?;
            read_changes(&client, &args, None).await.map(|_| ())
        }),
        Commands::Demo(args) => runtime.block_on(demo(args)),
    }
}

/// Opens the source named by `text`. The text may hold a password: no error repeats it.
async fn open_source(text: &str) -> anyhow::Result<Arc<dyn CdcSource>> {
    let text = text.trim();
    if let Some(dir) = text.strip_prefix("sim:") {
        return Ok(Arc::new(SimDb::open(&PathBuf::from(dir))?));
    }
    if text.starts_with("mssql://") || text.starts_with("sqlserver://") || text.contains('=') {
        let config = SqlServerConfig::parse(text)?;
        let source = SqlServerSource::connect(config)
            .await
            .context("connecting to SQL Server (the source text is not repeated here)")?;
        return Ok(Arc::new(source));
    }
    bail!(
        "unknown source: use sim:<DIR> (a directory made by `mssql-cdc-flight sim init`), \
         mssql://user:password@host:port/database or an ADO.NET connection string"
    )
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down: finishing the calls in flight");
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let text = match (&args.source, &args.source_file) {
        (Some(text), _) => text.clone(),
        (None, Some(path)) => std::fs::read_to_string(path)
            .with_context(|| format!("reading the source from {}", path.display()))?
            .lines()
            .next()
            .unwrap_or_default()
            .to_string(),
        (None, None) => bail!("give --source or --source-file"),
    };
    let source = open_source(&text).await?;
    tracing::info!(source = %source.describe(), "serving");
    let signer = args.key.signer()?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(TlsIdentity {
            certificate: std::fs::read(cert)
                .with_context(|| format!("reading {}", cert.display()))?,
            key: std::fs::read(key).with_context(|| format!("reading {}", key.display()))?,
        }),
        _ => None,
    };
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    // Tests and scripts read this line to find a port chosen with :0.
    println!("listening on {}", listener.local_addr()?);
    flight::serve(listener, source, signer, tls, shutdown_signal()).await?;
    Ok(())
}

fn sim(command: SimCommand) -> anyhow::Result<()> {
    match command {
        SimCommand::Init(args) => {
            let mut tables = sample::sample_tables();
            if args.wide {
                tables.push(sample::wide_table("dbo.wide".parse()?, 60));
            }
            let now = CommitTime(chrono::Utc::now().timestamp_micros());
            let db = SimDb::create(&args.dir, &tables, now)?;
            let mut writer = db.writer(Clock::Wall, args.seed)?;
            seed_rows(&mut writer, &"dbo.customers".parse()?, args.customers)?;
            seed_rows(&mut writer, &"dbo.orders".parse()?, args.orders)?;
            writer.publish()?;
            print_info(&db)?;
        }
        SimCommand::Run(args) => {
            let db = SimDb::open(&args.dir)?;
            let clock = match args.clock.as_str() {
                "wall" => Clock::Wall,
                "virtual" => Clock::Virtual { step_micros: 1_000 },
                other => bail!("unknown clock '{other}': use wall or virtual"),
            };
            let mut writer = db.writer(clock, args.seed)?;
            if let Some(journal) = &args.journal {
                writer.set_journal(journal)?;
            }
            let spec = args.workload.spec()?;
            let stop = Arc::new(AtomicBool::new(false));
            let flag = Arc::clone(&stop);
            ctrlc_flag(flag);
            let started = Instant::now();
            let report = mssql_cdc_flight::sim::workload::run(&mut writer, &spec, &stop)?;
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "workload: {} transactions, {} idle entries, {} change rows in {seconds:.2} s ({:.0} rows/s); lsn {} .. {}",
                report.transactions,
                report.idle,
                report.rows,
                report.rows as f64 / seconds.max(1e-9),
                report
                    .first_lsn
                    .map(|lsn| lsn.to_string())
                    .unwrap_or_default(),
                report
                    .last_lsn
                    .map(|lsn| lsn.to_string())
                    .unwrap_or_default(),
            );
        }
        SimCommand::Cleanup(args) => {
            let db = SimDb::open(&args.dir)?;
            let low_water_mark: Lsn = args.low_water_mark.parse()?;
            db.cleanup(args.capture_instance.as_deref(), low_water_mark)?;
            print_info(&db)?;
        }
        SimCommand::AddColumn(args) => {
            let db = SimDb::open(&args.dir)?;
            let mut writer = db.writer(Clock::Wall, 0)?;
            let lsn = writer.add_column(
                &args.table.parse()?,
                &args.column,
                &args.sql_type,
                !args.not_null,
            )?;
            println!("column {} added at {lsn}", args.column);
        }
        SimCommand::EnableCaptureInstance(args) => {
            let db = SimDb::open(&args.dir)?;
            let table: TableName = args.table.parse()?;
            let columns = if args.columns.is_empty() {
                let manifest = db.manifest()?;
                let definition = manifest.table(&table).context("no such table")?;
                definition
                    .columns
                    .iter()
                    .map(|column| column.name.clone())
                    .collect()
            } else {
                args.columns.clone()
            };
            let mut writer = db.writer(Clock::Wall, 0)?;
            let lsn = writer.enable_capture_instance(&table, &args.name, &columns)?;
            println!("capture instance {} enabled at {lsn}", args.name);
        }
        SimCommand::Info { dir } => print_info(&SimDb::open(&dir)?)?,
    }
    Ok(())
}

fn ctrlc_flag(flag: Arc<AtomicBool>) {
    std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async {
            if tokio::signal::ctrl_c().await.is_ok() {
                flag.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        });
    });
}

fn seed_rows(
    writer: &mut mssql_cdc_flight::sim::SimWriter,
    table: &TableName,
    rows: usize,
) -> anyhow::Result<()> {
    let mut remaining = rows;
    while remaining > 0 {
        let count = remaining.min(100);
        let mut tx = writer.begin();
        tx.insert(table, count)?;
        tx.commit()?;
        remaining -= count;
    }
    Ok(())
}

fn print_info(db: &SimDb) -> anyhow::Result<()> {
    let manifest = db.manifest()?;
    println!("simulated CDC database {}", db.dir().display());
    println!(
        "  max_lsn {}  commits {}  last commit {}",
        manifest
            .max_lsn
            .map(|lsn| lsn.to_string())
            .unwrap_or_else(|| "none".into()),
        manifest.mapping_entries - manifest.mapping_retained_from,
        manifest.last_commit_time
    );
    for table in &manifest.tables {
        println!(
            "  table {} ({} rows, key {})",
            table.table, table.row_count, table.key
        );
    }
    for ci in &manifest.capture_instances {
        let rows: u64 = ci.segments.iter().map(|segment| segment.rows).sum();
        println!(
            "  capture instance {} on {}: start {} min {} ({} columns, {rows} change rows)",
            ci.name,
            ci.table,
            ci.start_lsn,
            ci.min_lsn,
            ci.columns.len()
        );
    }
    Ok(())
}

/// Reads `(from, latest]` of a table with every endpoint in parallel; returns the new offset.
async fn read_changes(
    client: &CdcClient,
    args: &ReadArgs,
    start: Option<Offset>,
) -> anyhow::Result<Offset> {
    let start = match start {
        Some(offset) => offset,
        None => {
            client
                .action::<Offset>(
                    "initial_offset",
                    &InitialOffsetBody {
                        table: args.table.clone(),
                        starting: Some(args.from.clone()),
                    },
                )
                .await?
        }
    };
    let end: Offset = client
        .action(
            "latest_offset",
            &LatestOffsetBody {
                start: Some(start),
                max_commits: args.max_commits,
                upper: None,
            },
        )
        .await?;
    let mut command = ChangesCommand::new(args.table.clone(), start.lsn, Some(end.lsn));
    command.partitions = Some(args.partitions);
    command.min_partition_rows = Some(1_000);
    let plan = client.plan_changes(&command).await?;
    println!(
        "{}: range ({}, {}] planned: {} rows in {} endpoint(s)",
        args.table,
        start.lsn,
        end.lsn,
        plan.metadata.rows,
        plan.info.endpoint.len()
    );
    for event in &plan.metadata.events {
        println!("  event {} at {}: {}", event.event, event.lsn, event.detail);
    }
    let started = Instant::now();
    let mut reads = Vec::new();
    for endpoint in &plan.info.endpoint {
        let client = client.clone();
        let ticket = endpoint.ticket.clone().context("endpoint without ticket")?;
        reads.push(tokio::spawn(async move {
            client.collect_endpoint(&ticket).await
        }));
    }
    let mut operations = [0u64; 5];
    let mut total = 0u64;
    let mut first_batch = None;
    for read in reads {
        let (batches, completion) = read.await??;
        println!(
            "  endpoint {} [{} .. {}]: {} rows, complete",
            completion.capture_instance, completion.from, completion.to, completion.rows
        );
        for batch in batches {
            total += batch.num_rows() as u64;
            let column = batch
                .column_by_name("_operation")
                .context("no _operation column")?
                .as_any()
                .downcast_ref::<arrow::array::Int32Array>()
                .context("_operation is not int")?;
            for operation in column.values() {
                if let Some(count) = operations.get_mut(*operation as usize) {
                    *count += 1;
                }
            }
            if first_batch.is_none() && batch.num_rows() > 0 {
                first_batch = Some(batch);
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    println!(
        "  read {total} rows in {seconds:.3} s: {} inserts, {} updates (before+after {}), {} deletes",
        operations[2],
        operations[4],
        operations[3] + operations[4],
        operations[1]
    );
    if let Some(batch) = first_batch.filter(|_| args.show > 0) {
        let shown = batch.slice(0, args.show.min(batch.num_rows()));
        println!("{}", arrow::util::pretty::pretty_format_batches(&[shown])?);
    }
    println!("  next offset {}", end.to_json());
    Ok(end)
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let temporary = tempfile::tempdir()?;
    let dir = args
        .dir
        .clone()
        .unwrap_or_else(|| temporary.path().join("cdc_sim"));
    println!("1. simulated CDC database in {}", dir.display());
    let now = CommitTime(chrono::Utc::now().timestamp_micros());
    let db = SimDb::create(&dir, &sample::sample_tables(), now)?;
    let spec = WorkloadSpec {
        commits: Some(args.commits),
        ..WorkloadSpec::default()
    };
    let mut writer = db.writer(Clock::Wall, 7)?;
    seed_rows(&mut writer, &"dbo.customers".parse()?, 200)?;
    seed_rows(&mut writer, &"dbo.orders".parse()?, 500)?;
    let report = mssql_cdc_flight::sim::workload::run(&mut writer, &spec, &AtomicBool::new(false))?;
    println!(
        "   workload: {} transactions, {} change rows",
        report.transactions, report.rows
    );

    let server = LocalServer::start(Arc::new(db.clone()), TicketSigner::random()?).await?;
    println!("2. flight server on {}", server.url);
    let client = CdcClient::connect(&server.url).await?;
    let read = ReadArgs {
        server: server.url.clone(),
        table: "dbo.orders".into(),
        from: "earliest".into(),
        max_commits: None,
        partitions: 4,
        show: 5,
        tls_ca: None,
    };
    println!("3. read dbo.orders from the earliest offset");
    let offset = read_changes(&client, &read, None).await?;

    let report = tokio::task::spawn_blocking(move || {
        mssql_cdc_flight::sim::workload::run(&mut writer, &spec, &AtomicBool::new(false))
    })
    .await??;
    println!(
        "4. {} more transactions committed while the server runs",
        report.transactions
    );
    println!("5. read the next range from the offset of step 3");
    read_changes(&client, &ReadArgs { show: 0, ..read }, Some(offset)).await?;
    server.stop().await?;
    println!("done: every range ended with its completion marker");
    Ok(())
}
