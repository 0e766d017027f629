//! What each `mssql-cdc-flight` subcommand does with its parsed flags (`cli`).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use mssql_cdc_flight::client::{CdcClient, ClientTls};
use mssql_cdc_flight::flight::auth::Authenticator;
use mssql_cdc_flight::flight::local::LocalServer;
use mssql_cdc_flight::flight::masking::MaskPolicy;
use mssql_cdc_flight::flight::ticket::TicketSigner;
use mssql_cdc_flight::flight::{self, Limits, ServiceOptions, TlsIdentity};
use mssql_cdc_flight::mssql::{SqlServerConfig, SqlServerSource};
use mssql_cdc_flight::protocol::{ChangesCommand, InitialOffsetBody, LatestOffsetBody};
use mssql_cdc_flight::sim::workload::{Mix, WorkloadSpec};
use mssql_cdc_flight::sim::{Clock, SimDb, sample};
use mssql_cdc_flight::source::{CdcSource, TableName};
use mssql_cdc_flight::{CommitTime, Lsn, Offset};

use crate::cli::{
    DemoArgs, HealthArgs, LimitArgs, ReadArgs, ServeArgs, SimCommand, TicketKeyArgs, WorkloadArgs,
};

impl TicketKeyArgs {
    fn signer(&self) -> anyhow::Result<TicketSigner> {
        if !(self.ticket_hours > 0.0 && self.ticket_hours.is_finite()) {
            bail!("--ticket-hours must be a positive number of hours");
        }
        let lifetime = Duration::from_secs_f64(self.ticket_hours * 3600.0);
        let signer = match &self.ticket_key_file {
            Some(path) => TicketSigner::from_key_file(path)?,
            None => TicketSigner::random()?,
        };
        Ok(signer.with_lifetime(lifetime))
    }
}

impl LimitArgs {
    fn limits(&self) -> anyhow::Result<Limits> {
        let seconds = |name: &str, value: f64| {
            if value > 0.0 && value.is_finite() {
                Ok(Duration::from_secs_f64(value))
            } else {
                Err(anyhow::anyhow!(
                    "--{name} must be a positive number of seconds"
                ))
            }
        };
        let limits = Limits {
            max_batch_rows: self.max_batch_rows,
            max_batch_bytes: self.max_batch_bytes,
            max_chunks: self.max_chunks,
            max_seek_rows: self.max_seek_rows,
            max_streams: self.max_streams,
            max_streams_per_principal: self.max_streams_per_principal,
            max_calls_per_principal: self.max_calls_per_principal,
            stream_memory: self.stream_memory,
            call_timeout: seconds("call-timeout", self.call_timeout)?,
            max_request_bytes: self.max_request_bytes,
            keepalive_interval: seconds("keepalive-interval", self.keepalive_interval)?,
            keepalive_timeout: seconds("keepalive-timeout", self.keepalive_timeout)?,
            max_connections_per_peer: self.max_connections_per_peer,
            max_connections: self.max_connections,
            max_streams_per_connection: self.max_streams_per_connection,
            max_unauthenticated_per_peer: self.max_unauthenticated_per_peer,
            unauthenticated_timeout: seconds(
                "unauthenticated-timeout",
                self.unauthenticated_timeout,
            )?,
            stall_timeout: (self.stall_timeout != 0.0)
                .then(|| seconds("stall-timeout", self.stall_timeout))
                .transpose()?,
            source_share: self.source_share,
        };
        limits.check()?;
        Ok(limits)
    }
}

/// Whether every address `listen` names is a loopback one (`localhost` included).
fn is_loopback(listen: &str) -> bool {
    use std::net::ToSocketAddrs;
    match listen.to_socket_addrs() {
        Ok(addresses) => {
            let addresses: Vec<_> = addresses.collect();
            !addresses.is_empty() && addresses.iter().all(|address| address.ip().is_loopback())
        }
        Err(_) => false,
    }
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

/// TLS to `server` trusting the CA in the PEM file `--tls-ca` names, if any; none for an
/// `http://` address, which TLS settings would not encrypt (the image sets the CA for its own
/// server, and a sidecar's admin service on loopback is asked over `http://`).
fn tls_of(server: &str, ca: Option<&std::path::Path>) -> anyhow::Result<Option<ClientTls>> {
    if !mssql_cdc_proto::client::is_https_url(server) {
        return Ok(None);
    }
    ca.map(|path| {
        ClientTls::from_ca_file(path).with_context(|| format!("reading {}", path.display()))
    })
    .transpose()
}

/// `read`: the example client over plaintext or TLS.
pub async fn read(args: ReadArgs) -> anyhow::Result<()> {
    let tls = tls_of(&args.server, args.tls_ca.as_deref())?;
    let mut client = CdcClient::connect_with(&args.server, tls.as_ref()).await?;
    if let Some(token) = &args.token {
        client = client.with_token(token)?;
    }
    read_changes(&client, &args, None).await.map(|_| ())
}

/// Opens the source named by `text`. The text may hold a password: no error repeats it.
async fn open_source(text: &str) -> anyhow::Result<Arc<dyn CdcSource>> {
    let text = text.trim();
    if let Some(dir) = text.strip_prefix("sim:") {
        return Ok(Arc::new(SimDb::open(&PathBuf::from(dir))?));
    }
    if let Some(dir) = text.strip_prefix("seed-fake:") {
        let source = mssql_cdc_flight::seed_fake::SeedFake::open(&PathBuf::from(dir))?;
        return Ok(Arc::new(source));
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
         seed-fake:<DIR> (a FakeCdcDatabase of the seed library, mssql-cdc-pyspark), \
         mssql://user:password@host:port/database or an ADO.NET connection string"
    )
}

/// Reads the tokens file again on each SIGHUP (`kill -HUP`, `systemctl reload`): a revoked
/// token is refused from the next call on; a file that fails its checks is logged and the
/// principals stay as they were.
fn reload_on_hangup(authenticator: Arc<Authenticator>) {
    #[cfg(unix)]
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let Ok(mut hangups) = signal(SignalKind::hangup()) else {
            tracing::warn!("no SIGHUP handler: the tokens file is read at start only");
            return;
        };
        while hangups.recv().await.is_some() {
            match authenticator.reload() {
                Ok(principals) => tracing::info!(principals, "tokens file read again (SIGHUP)"),
                Err(error) => tracing::error!(%error,
                    "tokens file not read again: the principals stay as they were"),
            }
        }
    });
    #[cfg(not(unix))]
    drop(authenticator);
}

fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    let signal = mssql_cdc_proto::signals::shutdown();
    async move {
        signal.await;
        tracing::info!("shutting down: finishing the calls in flight");
    }
}

/// `health`: the server's gRPC health for the Flight service; an error unless SERVING.
pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    use tonic_health::pb::health_check_response::ServingStatus;
    let tls = tls_of(&args.server, args.tls_ca.as_deref())?;
    let endpoint = CdcClient::endpoint(&args.server, tls.as_ref())?
        .timeout(Duration::from_secs_f64(args.timeout))
        .connect_timeout(Duration::from_secs_f64(args.timeout));
    let channel = endpoint
        .connect()
        .await
        .with_context(|| format!("connecting to {}", args.server))?;
    let answer = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: args.service.clone(),
        })
        .await
        .with_context(|| format!("asking {} for its health", args.server))?
        .into_inner();
    let status = ServingStatus::try_from(answer.status).unwrap_or(ServingStatus::Unknown);
    println!("{}", status.as_str_name());
    if status != ServingStatus::Serving {
        bail!("{} is {}", args.server, status.as_str_name());
    }
    Ok(())
}

/// `serve`: the Flight server until Ctrl-C or SIGTERM.
pub async fn serve(args: ServeArgs) -> anyhow::Result<()> {
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
    // The tokens file holds hashes, no secret; these hold secrets.
    let secrets = [
        ("source", args.source_file.as_ref()),
        ("ticket key", args.key.ticket_key_file.as_ref()),
        ("TLS key", args.tls_key.as_ref()),
    ];
    for (what, path) in secrets {
        if let Some(path) = path.filter(|path| !path.as_os_str().is_empty()) {
            mssql_cdc_proto::secrets::warn_if_exposed(what, path);
        }
    }
    let read =
        |path: &PathBuf| std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    // An empty path is no path: the image's variables, emptied, serve without TLS.
    let given = |path: &Option<PathBuf>| path.clone().filter(|path| !path.as_os_str().is_empty());
    let tls = match (given(&args.tls_cert), given(&args.tls_key)) {
        (Some(cert), Some(key)) => Some(TlsIdentity {
            certificate: read(&cert)?,
            key: read(&key)?,
            client_ca: args.tls_client_ca.as_ref().map(read).transpose()?,
        }),
        _ => None,
    };
    let authenticator = match &args.tokens_file {
        Some(path) => {
            let authenticator = Arc::new(Authenticator::from_file(path)?);
            reload_on_hangup(Arc::clone(&authenticator));
            Some(authenticator)
        }
        None => None,
    };
    let loopback = is_loopback(&args.listen);
    if authenticator.is_none() && !loopback {
        if !args.insecure_no_auth {
            bail!(
                "refusing to serve {} without authentication: give --tokens-file (bearer \
                 tokens, mutual TLS) or, to let anyone who reaches the port read every table, \
                 --insecure-no-auth",
                args.listen
            );
        }
        tracing::warn!(listen = %args.listen,
            "serving without authentication (--insecure-no-auth): anyone who reaches the port reads every table");
    }
    if tls.is_none() && !loopback {
        if !args.insecure_no_tls {
            bail!(
                "refusing to serve {} without TLS: bearer tokens and rows would cross the \
                 network in cleartext; give --tls-cert and --tls-key (docs/security.md) or, \
                 where something else encrypts the path, --insecure-no-tls",
                args.listen
            );
        }
        tracing::warn!(listen = %args.listen,
            "serving without TLS (--insecure-no-tls): tokens and rows cross the network in cleartext");
    }
    if !loopback && signer.is_random() {
        tracing::warn!(
            "no ticket key file: tickets are signed with a random key of this process, so \
             replicas refuse each other's tickets (give every replica the same --ticket-key-file)"
        );
    }
    if !(args.tail_interval.is_finite() && (0.001..=60.0).contains(&args.tail_interval)) {
        anyhow::bail!(
            "--tail-interval must be 0.001 to 60 seconds, not {}",
            args.tail_interval
        );
    }
    let masks = match given(&args.masks) {
        Some(path) => {
            let masks = MaskPolicy::from_file(&path)?;
            if let Some(key) = masks.hash_key_file() {
                mssql_cdc_proto::secrets::warn_if_exposed("mask hash key", key);
            }
            tracing::info!(masks = ?masks, "serving masked columns");
            masks
        }
        None => MaskPolicy::none(),
    };
    let options = ServiceOptions {
        signer,
        limits: args.limits.limits()?,
        authenticator,
        health_interval: flight::HEALTH_PROBE_INTERVAL,
        tail_interval: Duration::from_secs_f64(args.tail_interval),
        masks: Arc::new(masks),
    };
    if let Some(address) = args.metrics_listen {
        mssql_cdc_proto::pages::serve_metrics(
            address,
            &[
                0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 60.0, 300.0,
            ],
        )
        .await
        .map_err(anyhow::Error::msg)?;
        tracing::info!(%address, "serving Prometheus metrics at /metrics");
    }
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    // Tests and scripts read this line to find a port chosen with :0.
    println!("listening on {}", listener.local_addr()?);
    flight::serve(listener, source, options, tls, shutdown_signal()).await?;
    Ok(())
}

/// `sim`: create and drive a simulated CDC database.
pub fn sim(command: SimCommand) -> anyhow::Result<()> {
    match command {
        SimCommand::Init(args) => {
            let mut tables = sample::sample_tables();
            if args.wide {
                tables.push(sample::wide_table("dbo.wide".parse()?, 60));
            }
            if args.types.is_some() {
                tables.push(sample::types());
            }
            let now = CommitTime(chrono::Utc::now().timestamp_micros());
            let db = SimDb::create(&args.dir, &tables, now)?;
            let mut writer = db.writer(Clock::Wall, args.seed)?;
            seed_rows(&mut writer, &"dbo.customers".parse()?, args.customers)?;
            seed_rows(&mut writer, &"dbo.orders".parse()?, args.orders)?;
            if let Some(rows) = args.types {
                seed_rows(&mut writer, &"dbo.types".parse()?, rows)?;
            }
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
                db.columns_of(&table)?
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

/// `demo`: the simulated database, the server on a loopback port and the example client.
pub async fn demo(args: DemoArgs) -> anyhow::Result<()> {
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
        token: None,
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
