//! Where the SQL Server source connects and how it reads.
//!
//! A source is named by a URL or an ADO.NET connection string, from the `--source` flag, the
//! `MSSQL_CDC_FLIGHT_SOURCE` variable or a file (`--source-file`), so passwords need not be
//! on a command line:
//!
//! ```text
//! mssql://reader:secret@db.example.com:1433/sales?ca=/etc/ssl/db-ca.pem&lock_timeout_ms=5000
//! Server=tcp:db.example.com,1433;Database=sales;User Id=reader;Password=secret;Encrypt=true
//! ```
//!
//! TLS is on and verifies the server's certificate against the system roots unless told
//! otherwise: `ca=` (ADO `TrustServerCertificateCA`) pins a CA file; trusting any certificate
//! (`trust_server_certificate=true`) must be asked for and logs a warning each connect;
//! plaintext (`encrypt=false`) still encrypts the login. The connection text is never logged:
//! [`SqlServerConfig::describe`] gives host, port and database only.
//!
//! Options beyond the connection (URL query or extra ADO keys, names case-insensitive):
//! `lock_timeout_ms`, `isolation` (`readCommitted`|`snapshot`), `source_time_zone`
//! (`auto`|`UTC`|a Windows zone), `pool_size`, `checkout_timeout_s` (how long a read waits in
//! line for a pooled connection, 300 by default), `command_timeout_s`, `packet_size`,
//! `application_name`, `readonly` (an availability group's readable secondary; ADO's
//! `ApplicationIntent=ReadOnly`), `access_token_file` (a Microsoft Entra ID access token,
//! re-read at every connect, instead of a SQL login), `login_timeout_s` (ADO's `Connect
//! Timeout`: how long opening a connection, TCP, TLS and login, may take; 15 by default, as
//! SqlClient's).

use std::collections::BTreeMap;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use tiberius::{AuthMethod, Config, EncryptionLevel};

use super::clock::ClockSetting;
use super::sql::Isolation;
use crate::error::{Error, Result};

/// Reads a source-table read may wait for, at most, per server round trip: snapshot reads
/// of big tables sort or scan for minutes before the first row (tiberius' default is 30 s).
pub const DEFAULT_COMMAND_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long opening a connection (TCP, TLS, login, a redirect followed) may take: SqlClient's
/// default `Connect Timeout`. Without one, an address that drops packets holds a connect for
/// the kernel's TCP retries, and a server that accepts but never answers holds it for ever.
pub const DEFAULT_LOGIN_TIMEOUT: Duration = Duration::from_secs(15);
/// The largest TDS packet, for bulk reads.
pub const PACKET_SIZE: u32 = 32767;

/// Everything the SQL Server source needs to connect and read.
#[derive(Clone)]
pub struct SqlServerConfig {
    /// The tiberius configuration (host, login, TLS, timeouts).
    pub tiberius: Config,
    /// `host:port/database`, for logs.
    pub target: String,
    /// Whether the server certificate is trusted without checking (warned at connect).
    pub trusts_any_certificate: bool,
    /// `SET LOCK_TIMEOUT` before reads of source tables.
    pub lock_timeout_ms: Option<u32>,
    /// Isolation of source-table reads.
    pub isolation: Isolation,
    /// The server clock (`sourceTimeZone`).
    pub clock: ClockSetting,
    /// Connections kept open at most.
    pub pool_size: u32,
    /// How long a read waits in line for a connection before `UNAVAILABLE`.
    pub checkout_timeout: Duration,
    /// How long opening one connection may take; `None`: no bound (`login_timeout_s=0`).
    pub login_timeout: Option<Duration>,
    /// A file holding a Microsoft Entra ID access token for the login, read at every connect
    /// (tokens live about an hour; whatever refreshes the file, the next connection uses it).
    pub access_token_file: Option<PathBuf>,
}

impl fmt::Debug for SqlServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the login: the tiberius Config holds the password.
        f.debug_struct("SqlServerConfig")
            .field("target", &self.target)
            .field("trusts_any_certificate", &self.trusts_any_certificate)
            .field("lock_timeout_ms", &self.lock_timeout_ms)
            .field("isolation", &self.isolation)
            .field("clock", &self.clock)
            .field("pool_size", &self.pool_size)
            .field("checkout_timeout", &self.checkout_timeout)
            .field("login_timeout", &self.login_timeout)
            .field("access_token_file", &self.access_token_file)
            .finish_non_exhaustive()
    }
}

/// Options shared by both spellings, read from the URL query or the extra ADO keys.
#[derive(Default)]
struct Extras {
    lock_timeout_ms: Option<u32>,
    isolation: Isolation,
    clock: Option<ClockSetting>,
    pool_size: Option<u32>,
    checkout_timeout: Option<Duration>,
    login_timeout: Option<Option<Duration>>,
    command_timeout: Option<Duration>,
    packet_size: Option<u32>,
    access_token_file: Option<PathBuf>,
}

impl Extras {
    /// Takes our keys out of `pairs` (lower-cased names without blanks or underscores).
    fn take(pairs: &mut BTreeMap<String, String>) -> Result<Self> {
        let number = |key: &str, value: String| -> Result<u64> {
            value.trim().parse::<u64>().map_err(|_| {
                Error::invalid(format!(
                    "{key} must be a non-negative whole number, not '{value}'"
                ))
            })
        };
        let mut extras = Extras::default();
        if let Some(value) = pairs.remove("locktimeoutms") {
            extras.lock_timeout_ms = Some(
                u32::try_from(number("lock_timeout_ms", value)?)
                    .map_err(|_| Error::invalid("lock_timeout_ms is too large"))?,
            );
        }
        if let Some(value) = pairs
            .remove("isolation")
            .or_else(|| pairs.remove("isolationlevel"))
        {
            extras.isolation = value.parse()?;
        }
        if let Some(value) = pairs
            .remove("sourcetimezone")
            .or_else(|| pairs.remove("timezone"))
        {
            extras.clock = Some(value.parse()?);
        }
        if let Some(value) = pairs.remove("poolsize") {
            let size = number("pool_size", value)?;
            if !(1..=256).contains(&size) {
                return Err(Error::invalid("pool_size must be between 1 and 256"));
            }
            extras.pool_size = Some(size as u32);
        }
        if let Some(value) = pairs.remove("checkouttimeouts") {
            let seconds = number("checkout_timeout_s", value)?;
            if !(1..=3600).contains(&seconds) {
                return Err(Error::invalid(
                    "checkout_timeout_s must be between 1 and 3600 seconds",
                ));
            }
            extras.checkout_timeout = Some(Duration::from_secs(seconds));
        }
        // ADO.NET spells it `Connect Timeout`, `Connection Timeout` or `Timeout`.
        let login = [
            "logintimeouts",
            "connecttimeout",
            "connectiontimeout",
            "timeout",
        ]
        .iter()
        .filter_map(|key| pairs.remove(*key))
        .next_back();
        if let Some(value) = login {
            // 0 waits without a bound, as SqlClient's `Connect Timeout=0`.
            let seconds = number("login_timeout_s", value)?;
            extras.login_timeout = Some((seconds > 0).then(|| Duration::from_secs(seconds)));
        }
        if let Some(value) = pairs
            .remove("commandtimeouts")
            .or_else(|| pairs.remove("commandtimeout"))
        {
            let seconds = number("command_timeout_s", value)?;
            extras.command_timeout = (seconds > 0).then(|| Duration::from_secs(seconds));
        }
        if let Some(value) = pairs.remove("packetsize") {
            let size = number("packet_size", value)?;
            if !(512..=32767).contains(&size) {
                return Err(Error::invalid("packet_size must be between 512 and 32767"));
            }
            extras.packet_size = Some(size as u32);
        }
        if let Some(value) = pairs.remove("accesstokenfile") {
            if value.trim().is_empty() {
                return Err(Error::invalid("access_token_file names no file"));
            }
            extras.access_token_file = Some(PathBuf::from(value.trim()));
        }
        Ok(extras)
    }
}

fn normalize_key(key: &str) -> String {
    key.chars()
        .filter(|c| !c.is_whitespace() && *c != '_')
        .collect::<String>()
        .to_ascii_lowercase()
}

fn truthy(key: &str, value: &str) -> Result<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "y" => Ok(true),
        "false" | "0" | "no" | "n" => Ok(false),
        _ => Err(Error::invalid(format!(
            "{key} must be true or false, not '{value}'"
        ))),
    }
}

/// Decodes `%XX` escapes of a URL part.
fn percent_decode(text: &str) -> Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        if bytes[index] == b'%' {
            let hex = text
                .get(index + 1..index + 3)
                .and_then(|digits| u8::from_str_radix(digits, 16).ok())
                .ok_or_else(|| {
                    Error::invalid("a '%' in the source URL is not followed by two hex digits")
                })?;
            out.push(hex);
            index += 3;
        } else {
            out.push(bytes[index]);
            index += 1;
        }
    }
    String::from_utf8(out).map_err(|_| Error::invalid("the source URL does not decode to UTF-8"))
}

impl SqlServerConfig {
    /// Parses a `mssql://` URL or an ADO.NET connection string.
    pub fn parse(text: &str) -> Result<Self> {
        let text = text.trim();
        if let Some(rest) = text
            .strip_prefix("mssql://")
            .or_else(|| text.strip_prefix("sqlserver://"))
        {
            Self::from_url(rest)
        } else if text.contains('=') {
            Self::from_ado(text)
        } else {
            Err(Error::invalid(
                "a SQL Server source is a mssql://user:password@host:port/database URL or an \
                 ADO.NET connection string (Server=...;Database=...;User Id=...;Password=...)",
            ))
        }
    }

    fn from_url(rest: &str) -> Result<Self> {
        let (location, query) = rest.split_once('?').unwrap_or((rest, ""));
        // A '?' in a password cuts the URL before its '@': the password's start would be
        // read as the address and its end as the options, and echoed in their errors. Say
        // so without a word of the URL.
        let password_cut = query
            .find('@')
            .is_some_and(|at| query.find('=').is_none_or(|equals| at < equals));
        if !location.contains('@') && password_cut {
            return Err(Error::invalid(
                "the source URL has a '?' before its '@': percent-encode ? (%3F), @ (%40) \
                 and % (%25) in the user and the password",
            ));
        }
        let (login, address) = match location.rsplit_once('@') {
            Some((login, address)) => (Some(login), address),
            None => (None, location),
        };
        let (server, database) = address.split_once('/').unwrap_or((address, ""));
        let (host, port) = match server.rsplit_once(':') {
            Some((host, port)) => (
                host,
                // Not echoed: with a ':' in an unencoded password, what is read as the port
                // may be part of it.
                port.parse::<u16>().map_err(|_| {
                    Error::invalid(
                        "the port after the host's ':' is not a number (percent-encode : \
                         (%3A) and @ (%40) in the user and the password)",
                    )
                })?,
            ),
            None => (server, 1433),
        };
        if host.is_empty() {
            return Err(Error::invalid("the source URL names no host"));
        }
        let mut pairs = BTreeMap::new();
        for pair in query.split('&').filter(|pair| !pair.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, "true"));
            pairs.insert(normalize_key(&percent_decode(key)?), percent_decode(value)?);
        }
        let mut config = Config::new();
        config.host(host);
        config.port(port);
        let database = percent_decode(database)?;
        if !database.is_empty() {
            config.database(&database);
        }
        if let Some(login) = login {
            let (user, password) = login.split_once(':').unwrap_or((login, ""));
            config.authentication(AuthMethod::sql_server(
                percent_decode(user)?,
                percent_decode(password)?,
            ));
        }
        let extras = Extras::take(&mut pairs)?;
        if extras.access_token_file.is_some() && login.is_some() {
            return Err(Error::invalid(
                "access_token_file replaces the user and password: give one login, not both",
            ));
        }
        let mut trusts_any = false;
        let mut plaintext = false;
        if let Some(value) = pairs.remove("encrypt") {
            config.encryption(match value.to_ascii_lowercase().as_str() {
                "strict" => EncryptionLevel::Strict,
                "true" | "yes" | "required" => EncryptionLevel::Required,
                "false" | "no" | "off" => {
                    plaintext = true;
                    EncryptionLevel::Off
                }
                _ => {
                    return Err(Error::invalid(format!(
                        "encrypt must be strict, true or false, not '{value}'"
                    )));
                }
            });
        }
        let trust = match pairs.remove("trustservercertificate") {
            Some(value) => truthy("trust_server_certificate", &value)?,
            None => false,
        };
        let ca = pairs
            .remove("ca")
            .or_else(|| pairs.remove("trustservercertificateca"));
        match (trust, ca) {
            (true, Some(_)) => {
                return Err(Error::invalid(
                    "trust_server_certificate and ca are exclusive: pin a CA or trust any certificate",
                ));
            }
            (true, None) => {
                config.trust_cert();
                trusts_any = true;
            }
            (false, Some(path)) => config.trust_cert_ca(path),
            (false, None) => {}
        }
        if let Some(value) = pairs.remove("hostnameincertificate") {
            config.hostname_in_certificate(value);
        }
        if let Some(value) = pairs.remove("applicationname") {
            config.application_name(value);
        } else {
            config.application_name("mssql-cdc-flight");
        }
        if let Some(value) = pairs.remove("readonly") {
            config.readonly(truthy("readonly", &value)?);
        }
        if let Some(unknown) = pairs.keys().next() {
            return Err(Error::invalid(format!(
                "unknown source URL option '{unknown}' (see docs/sqlserver.md for the options)"
            )));
        }
        let target = format!("{host}:{port}/{database}");
        Self::finish(config, target, trusts_any, plaintext, extras)
    }

    fn from_ado(text: &str) -> Result<Self> {
        // Our keys first (tiberius ignores unknown ones), then tiberius' own parser for the
        // connection keys, so quoting follows ADO.NET exactly.
        let mut pairs = BTreeMap::new();
        let mut database = String::new();
        let mut trusts_any = false;
        for pair in text.split(';') {
            if let Some((key, value)) = pair.split_once('=') {
                let key = normalize_key(key);
                let value = value.trim().to_string();
                match key.as_str() {
                    "database" | "initialcatalog" => database = value.clone(),
                    "trustservercertificate" => {
                        trusts_any = truthy("TrustServerCertificate", &value)?
                    }
                    _ => {}
                }
                pairs.insert(key, value);
            }
        }
        let extras = Extras::take(&mut pairs)?;
        let login_keys = ["userid", "uid", "user", "username", "password", "pwd"];
        if extras.access_token_file.is_some()
            && login_keys.iter().any(|key| pairs.contains_key(*key))
        {
            return Err(Error::invalid(
                "AccessTokenFile replaces User Id and Password: give one login, not both",
            ));
        }
        let mut config = Config::from_ado_string(text).map_err(|error| {
            // The error names a key, never a value.
            Error::invalid(format!(
                "the ADO.NET connection string does not parse: {error}"
            ))
        })?;
        if !pairs.contains_key("applicationname") {
            config.application_name("mssql-cdc-flight");
        }
        let target = format!("{}/{database}", config.get_addr());
        // Anything but an encrypting value: tiberius also reads `DANGER_PLAINTEXT` (no TLS at
        // all), which a list of the false values missed.
        let plaintext = pairs.get("encrypt").is_some_and(|value| {
            !matches!(
                value.to_ascii_lowercase().as_str(),
                "true" | "yes" | "strict"
            )
        });
        Self::finish(config, target, trusts_any, plaintext, extras)
    }

    fn finish(
        mut config: Config,
        target: String,
        trusts_any: bool,
        plaintext: bool,
        extras: Extras,
    ) -> Result<Self> {
        // An access token is a bearer credential: it goes only over an encrypted connection.
        if extras.access_token_file.is_some() && plaintext {
            return Err(Error::invalid(
                "access_token_file needs an encrypted connection: drop encrypt=false",
            ));
        }
        config.packet_size(extras.packet_size.unwrap_or(PACKET_SIZE));
        config.command_timeout(Some(
            extras.command_timeout.unwrap_or(DEFAULT_COMMAND_TIMEOUT),
        ));
        Ok(SqlServerConfig {
            tiberius: config,
            target,
            trusts_any_certificate: trusts_any,
            lock_timeout_ms: extras.lock_timeout_ms,
            isolation: extras.isolation,
            clock: extras.clock.unwrap_or(ClockSetting::Auto),
            pool_size: extras.pool_size.unwrap_or(8),
            checkout_timeout: extras
                .checkout_timeout
                .unwrap_or(super::pool::DEFAULT_CHECKOUT_TIMEOUT),
            login_timeout: extras.login_timeout.unwrap_or(Some(DEFAULT_LOGIN_TIMEOUT)),
            access_token_file: extras.access_token_file,
        })
    }

    /// `mssql://host:port/database`: what logs and `describe` show.
    pub fn describe(&self) -> String {
        format!("mssql://{}", self.target)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mssql::clock::ServerClock;

    #[test]
    fn urls_carry_login_database_and_options() {
        let config = SqlServerConfig::parse(
            "mssql://reader:p%40ss%3Bword@db.example.com:14330/sales?lock_timeout_ms=5000\
             &isolation=snapshot&source_time_zone=UTC&pool_size=4&checkout_timeout_s=90&ca=/etc/ca.pem",
        )
        .expect("parses");
        assert_eq!(config.target, "db.example.com:14330/sales");
        assert_eq!(config.describe(), "mssql://db.example.com:14330/sales");
        assert_eq!(config.tiberius.get_addr(), "db.example.com:14330");
        assert_eq!(config.lock_timeout_ms, Some(5000));
        assert_eq!(config.isolation, Isolation::Snapshot);
        assert_eq!(config.clock, ClockSetting::Fixed(ServerClock::Utc));
        assert_eq!(config.pool_size, 4);
        assert_eq!(config.checkout_timeout, Duration::from_secs(90));
        assert!(!config.trusts_any_certificate);
        assert_eq!(config.tiberius.get_packet_size(), Some(PACKET_SIZE));
        assert_eq!(
            config.tiberius.get_command_timeout(),
            Some(DEFAULT_COMMAND_TIMEOUT)
        );
    }

    #[test]
    fn the_login_timeout_has_sqlclients_default_and_its_names() {
        let default = SqlServerConfig::parse("mssql://u:p@h/db").expect("parses");
        assert_eq!(default.login_timeout, Some(DEFAULT_LOGIN_TIMEOUT));
        for text in [
            "mssql://u:p@h/db?login_timeout_s=7",
            "Server=tcp:h,1433;Database=db;User Id=u;Password=p;Connect Timeout=7",
            "Server=tcp:h,1433;Database=db;User Id=u;Password=p;Connection Timeout=7",
        ] {
            let config = SqlServerConfig::parse(text).expect(text);
            assert_eq!(config.login_timeout, Some(Duration::from_secs(7)), "{text}");
        }
        let unbounded = "Server=tcp:h,1433;Database=db;User Id=u;Password=p;Connect Timeout=0";
        let config = SqlServerConfig::parse(unbounded).expect("0 waits without a bound");
        assert_eq!(config.login_timeout, None);
        assert!(SqlServerConfig::parse("mssql://u:p@h/db?login_timeout_s=x").is_err());
    }

    #[test]
    fn every_form_encrypts_the_whole_session_unless_told_otherwise() {
        // No `Encrypt=` in an ADO.NET string and no `encrypt` in a URL: tiberius' Required
        // (TLS for the whole session, issue 54), not Off (which encrypts the login only).
        for text in [
            "Server=tcp:db,1433;Database=sales;User Id=u;Password=p",
            "mssql://u:p@db/sales",
        ] {
            let config = SqlServerConfig::parse(text).expect("parses");
            let shown = format!("{:?}", config.tiberius);
            assert!(shown.contains("encryption: Required"), "{text}: {shown}");
        }
        let off = SqlServerConfig::parse("mssql://u:p@db/sales?encrypt=false").expect("parses");
        assert!(format!("{:?}", off.tiberius).contains("encryption: Off"));
    }

    #[test]
    fn the_password_never_shows() {
        let config = SqlServerConfig::parse("mssql://reader:hunter2@localhost/db").expect("parses");
        let shown = format!("{config:?} {}", config.describe());
        assert!(!shown.contains("hunter2"), "{shown}");
        let ado = SqlServerConfig::parse(
            "Server=tcp:localhost,1433;Database=db;User Id=sa;Password=hunter2;Encrypt=true",
        )
        .expect("parses");
        let shown = format!("{ado:?} {}", ado.describe());
        assert!(!shown.contains("hunter2"), "{shown}");
        assert_eq!(ado.describe(), "mssql://localhost:1433/db");
        // A '?' in an unencoded password: refused without a piece of it.
        for url in [
            "mssql://reader:hun?ter2@localhost/db",
            "mssql://reader:hun:ter?2@localhost:1433/db?encrypt=true",
        ] {
            let error = SqlServerConfig::parse(url).expect_err(url).to_string();
            assert!(error.contains("percent-encode"), "{url}: {error}");
            assert!(!error.contains("ter"), "{url}: {error}");
        }
        let encoded = SqlServerConfig::parse("mssql://reader:hun%3Fter2@localhost/db");
        assert!(encoded.is_ok(), "an encoded '?' parses");
        // An option value holding '@' in a URL without a login is not taken for a password.
        let options = SqlServerConfig::parse("mssql://localhost/db?access_token_file=/s/a@b");
        assert!(options.is_ok(), "{options:?}");
        // A login without its host reads the password as a port: not echoed.
        let error = SqlServerConfig::parse("mssql://reader:hunter2")
            .expect_err("the port is not a number")
            .to_string();
        assert!(!error.contains("hunter2"), "{error}");
    }

    #[test]
    fn ado_strings_take_our_options_too() {
        let config = SqlServerConfig::parse(
            "Server=tcp:db,1444;Database=sales;User Id=sa;Password='a;b';\
             TrustServerCertificate=true;LockTimeoutMs=250;SourceTimeZone=E. South America Standard Time",
        )
        .expect("parses");
        assert!(config.trusts_any_certificate);
        assert_eq!(config.lock_timeout_ms, Some(250));
        assert_eq!(
            config.clock,
            ClockSetting::Fixed(ServerClock::Zone("E. South America Standard Time".into()))
        );
        assert_eq!(config.tiberius.get_addr(), "db:1444");
    }

    #[test]
    fn an_entra_id_access_token_file_replaces_the_sql_login() {
        let url = SqlServerConfig::parse(
            "mssql://db.database.windows.net/sales?access_token_file=/run/secrets/entra-token&readonly=true",
        )
        .expect("parses");
        assert_eq!(
            url.access_token_file.as_deref(),
            Some(std::path::Path::new("/run/secrets/entra-token"))
        );
        let ado = SqlServerConfig::parse(
            "Server=tcp:db.database.windows.net,1433;Database=sales;ApplicationIntent=ReadOnly;\
             AccessTokenFile=/run/secrets/entra-token",
        )
        .expect("parses");
        assert_eq!(ado.access_token_file, url.access_token_file);
        assert!(!format!("{ado:?}").contains("Password"));
        for (text, expected) in [
            (
                "mssql://reader:pw@h/db?access_token_file=/t",
                "replaces the user and password",
            ),
            (
                "Server=h;User Id=sa;Password=pw;AccessTokenFile=/t",
                "replaces User Id and Password",
            ),
            (
                "mssql://h/db?access_token_file=/t&encrypt=false",
                "encrypted connection",
            ),
            (
                "Server=h;Encrypt=false;AccessTokenFile=/t",
                "encrypted connection",
            ),
            (
                "Server=h;Encrypt=DANGER_PLAINTEXT;AccessTokenFile=/t",
                "encrypted connection",
            ),
            ("mssql://h/db?access_token_file=", "names no file"),
        ] {
            let error = SqlServerConfig::parse(text).expect_err(text);
            assert!(error.to_string().contains(expected), "{text}: {error}");
        }
    }

    #[test]
    fn bad_options_are_refused_by_name() {
        for (text, expected) in [
            ("mssql://h/db?pool_size=0", "pool_size"),
            ("mssql://h/db?lock_timeout_ms=soon", "lock_timeout_ms"),
            ("mssql://h/db?isolation=nolock", "isolation level"),
            ("mssql://h/db?encrypt=maybe", "encrypt"),
            (
                "mssql://h/db?colour=blue",
                "unknown source URL option 'colour'",
            ),
            (
                "mssql://h/db?trust_server_certificate=true&ca=/x",
                "exclusive",
            ),
            ("mssql://h:port/db", "port"),
            ("mssql://h/db?source_time_zone=UTC';--", "time zone"),
            ("just-a-host", "mssql://"),
        ] {
            let error = SqlServerConfig::parse(text).expect_err(text);
            assert!(error.to_string().contains(expected), "{text}: {error}");
        }
    }
}
