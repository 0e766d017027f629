//! The `mssql-cdc-flight` command: the Flight server, the simulated CDC database, an example
//! client and the demo. Flags: `cli`; what each subcommand does: `commands`.

use clap::Parser;

mod cli;
mod commands;

use cli::{Cli, Commands};

// The system allocator on purpose: under many concurrent streams mimalloc (v3) kept four
// times the live bytes resident (its purge delay and eager arena commit), glibc about two,
// at the same rows/s (docs/operations.md, "Memory").

fn main() -> anyhow::Result<()> {
    let Cli { log, command } = Cli::parse();
    mssql_cdc_flight::install_crypto_provider();
    log.init("info");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match command {
        Commands::Serve(args) => runtime.block_on(commands::serve(*args)),
        Commands::Sim(command) => commands::sim(command),
        Commands::Read(args) => runtime.block_on(commands::read(args)),
        Commands::Demo(args) => runtime.block_on(commands::demo(args)),
        Commands::Health(args) => runtime.block_on(commands::health(args)),
    }
}
