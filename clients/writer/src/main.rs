//! The `mssql-cdc-writer` command: stream a table from an mssql-cdc-flight server into Delta.

use clap::Parser;

mod cli;
mod commands;
#[cfg(feature = "sim")]
mod demo;

use cli::{Cli, Commands};

// As in the server: per-batch multi-megabyte Arrow and Parquet buffers are reused by
// mimalloc instead of going back to mmap/munmap.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// delta-rs' kernel logs every snapshot load at INFO and its MERGE a WARN about its own
/// metrics; neither is news to a user of the writer.
const DEFAULT_LOG_FILTER: &str = "info,buoyant_kernel=warn,deltalake_core::operations::merge=error,deltalake_core::kernel::transaction=warn";

fn main() -> anyhow::Result<()> {
    let Cli { log, command } = Cli::parse();
    mssql_cdc_proto::install_crypto_provider();
    log.init(DEFAULT_LOG_FILTER);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        match command {
            Commands::Run(args) => commands::run(*args).await,
            Commands::Status { config } => commands::print_status(config).await,
            Commands::Freshness { control, table } => {
                commands::print_freshness(&control, &table).await
            }
            Commands::Maintain(args) => commands::maintain(*args).await,
            Commands::Backfill(args) => commands::backfill(*args).await,
            Commands::Snapshot(command) => commands::snapshot_command(*command).await,
            Commands::Apply(args) => commands::apply(*args).await,
            Commands::History(args) => commands::history(*args).await,
            Commands::Reconcile(args) => commands::reconcile(*args).await,
            Commands::Seed(args) => commands::seed(*args).await,
            #[cfg(feature = "sim")]
            Commands::Demo(args) => match args.scenario.as_str() {
                "data-loss" => demo::run_data_loss(args.dir, args.commits).await,
                _ => demo::run(args.dir, args.commits).await,
            },
        }
    })
}
