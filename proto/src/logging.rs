//! How the project's binaries log: to standard error, filtered by `RUST_LOG`, as text for
//! people or, with `--log-format json` (`MSSQL_CDC_LOG_FORMAT=json`), one JSON object per
//! line for log pipelines (`timestamp`, `level`, `target`, `fields` with the message and the
//! event's fields).

/// The variable choosing the log format: `text` (default) or `json`.
pub const LOG_FORMAT_VARIABLE: &str = "MSSQL_CDC_LOG_FORMAT";

/// The log formats: what `--log-format` and [`LOG_FORMAT_VARIABLE`] accept.
pub const LOG_FORMATS: [&str; 2] = ["text", "json"];

/// The binaries' logging flag, flattened into each command line.
#[derive(clap::Args, Clone, Debug)]
pub struct LogArgs {
    /// How to log to standard error: `text` for people, `json` for log pipelines (one JSON
    /// object per line; docs/operations.md, "Logs").
    #[arg(long, global = true, default_value = "text", value_parser = LOG_FORMATS, env = LOG_FORMAT_VARIABLE)]
    pub log_format: String,
}

impl LogArgs {
    /// Installs the process's logger in the format asked for.
    pub fn init(&self, default_filter: &str) {
        init_with(default_filter, self.log_format == "json");
    }
}

/// Installs the process's logger in the format [`LOG_FORMAT_VARIABLE`] names (benches and
/// tests; the binaries take `--log-format`, which reads the same variable).
pub fn init(default_filter: &str) {
    let json = std::env::var(LOG_FORMAT_VARIABLE).is_ok_and(|format| format == "json");
    init_with(default_filter, json);
}

/// Installs the process's logger, as JSON lines when `json`; `default_filter` applies when
/// `RUST_LOG` is unset. A logger installed already is kept.
pub fn init_with(default_filter: &str, json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match json {
        true => builder.json().try_init(),
        false => builder.try_init(),
    };
}
