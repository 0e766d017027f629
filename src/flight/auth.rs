//! Who calls, and which tables they may read.
//!
//! Principals come from a tokens file (JSON, docs/security.md): each has a name, the tables
//! it may read (globs on `schema.table`, `*` and `?`, case-insensitive as SQL Server's default
//! collations compare names), and how it proves itself: the SHA-256 of a bearer token, and/or
//! the SHA-256 of a client certificate (mutual TLS). The file holds hashes only, so it is no
//! secret. Every call passes [`interceptor`], which puts the caller's [`Principal`] in the
//! request's extensions or refuses the call with `UNAUTHENTICATED`; the service then checks
//! each table a call reaches ([`Principal::check`]). Tokens are compared in constant time and
//! never logged.
//!
//! Flight's `Handshake` with basic credentials (user = principal name, password = its token)
//! answers with the `authorization: Bearer` header, so pyarrow's `authenticate_basic_token`
//! works; the bearer token is the principal's token itself.

use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use mssql_cdc_proto::serving::Admissions;
use ring::digest;
use serde::Deserialize;
use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

use crate::error::{Error, Result};
use crate::source::TableName;

/// A caller the server knows, and the tables it may read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The principal's name (logged; never a secret).
    pub name: String,
    tables: Vec<String>,
    /// Tables whose masked columns this principal reads in clear (globs as `tables`).
    clear: Vec<String>,
    anonymous: bool,
}

impl Principal {
    /// The caller of a server without authentication (loopback or `--insecure-no-auth`): it
    /// may read every table, its masked columns masked.
    pub fn anonymous() -> Self {
        Principal {
            name: "anonymous".into(),
            tables: vec!["*".into()],
            clear: Vec::new(),
            anonymous: true,
        }
    }

    /// Whether this principal reads the masked columns of `table` in clear (its `clear`
    /// grant); never without authentication.
    pub fn reads_clear(&self, table: &TableName) -> bool {
        let name = table.to_string().to_lowercase();
        !self.anonymous && self.clear.iter().any(|glob| glob_matches(glob, &name))
    }

    /// The name per-principal bounds count this caller under; `None` for the anonymous
    /// caller, whom every caller shares (bound by the totals only).
    pub fn bounded_name(&self) -> Option<&str> {
        (!self.anonymous).then_some(self.name.as_str())
    }

    /// Whether this principal may read `table`.
    pub fn may_read(&self, table: &TableName) -> bool {
        let name = table.to_string().to_lowercase();
        self.tables.iter().any(|glob| glob_matches(glob, &name))
    }

    /// Whether this principal may read every table (`*`, or no authentication).
    pub fn reads_every_table(&self) -> bool {
        self.anonymous || self.tables.iter().any(|glob| glob == "*")
    }

    /// `PERMISSION_DENIED` unless this principal may read `table`.
    pub fn check(&self, table: &TableName) -> Result<()> {
        match self.may_read(table) {
            true => Ok(()),
            false => Err(Error::NotAuthorized {
                principal: self.name.clone(),
                table: table.to_string(),
            }),
        }
    }
}

/// Whether `name` matches `glob` (the glob lower-cased): `*` any run and `?` one character,
/// neither crossing the dot between schema and table, so `sales*` grants no table of a
/// schema `sales_private`; a lone `*` grants every table.
fn glob_matches(glob: &str, name: &str) -> bool {
    if glob == "*" {
        return true;
    }
    let glob: Vec<char> = glob.to_lowercase().chars().collect();
    let name: Vec<char> = name.chars().collect();
    // Iterative matching with one backtrack point: at worst glob × name steps, never
    // exponential, whatever a tokens file holds.
    let (mut g, mut n) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        if g < glob.len() && ((glob[g] == '?' && name[n] != '.') || glob[g] == name[n]) {
            g += 1;
            n += 1;
        } else if g < glob.len() && glob[g] == '*' {
            star = Some((g, n));
            g += 1;
        } else if let Some((star_g, star_n)) = star
            && name[star_n] != '.'
        {
            g = star_g + 1;
            n = star_n + 1;
            star = Some((star_g, star_n + 1));
        } else {
            return false;
        }
    }
    glob[g..].iter().all(|c| *c == '*')
}

/// One principal of the tokens file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PrincipalEntry {
    name: String,
    tables: Vec<String>,
    /// Tables whose masked columns the principal reads in clear.
    #[serde(default)]
    clear: Vec<String>,
    #[serde(default)]
    token_sha256: Option<String>,
    #[serde(default)]
    certificate_sha256: Option<String>,
}

/// The tokens file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    principals: Vec<PrincipalEntry>,
}

struct Known {
    principal: Arc<Principal>,
    token: Option<[u8; 32]>,
    certificate: Option<[u8; 32]>,
}

/// The principals a server accepts; those of a tokens file are read again by
/// [`Authenticator::reload`] (on SIGHUP), so a token is revoked without a restart.
pub struct Authenticator {
    known: std::sync::RwLock<Arc<Vec<Known>>>,
    path: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let known = self.current();
        let names: Vec<&str> = known.iter().map(|k| k.principal.name.as_str()).collect();
        f.debug_struct("Authenticator")
            .field("principals", &names)
            .finish()
    }
}

/// Whether two hashes are equal, in time independent of where they differ.
fn same_hash(left: &[u8; 32], right: &[u8; 32]) -> bool {
    left.iter()
        .zip(right)
        .fold(0u8, |difference, (l, r)| difference | (l ^ r))
        == 0
}

/// The SHA-256 of `bytes`.
pub fn sha256(bytes: &[u8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    out.copy_from_slice(digest::digest(&digest::SHA256, bytes).as_ref());
    out
}

/// The fewest characters a bearer token (or a basic password) may have: shorter ones are
/// refused before any lookup, so a guessable token never authenticates.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Tokens whose hashes a tokens file may not hold: the empty string (what the documented
/// `printf %s "$TOKEN" | sha256sum` hashes when `TOKEN` is unset) and words tried first.
const WEAK_TOKENS: &[&str] = &[
    "", "test", "foo", "bar", "baz", "secret", "password", "token", "changeme", "admin", "root",
    "letmein", "example", "123456", "12345678",
];

fn hash_field(principal: &str, field: &str, hex_text: &str) -> Result<[u8; 32]> {
    let bytes = hex::decode(hex_text.trim())
        .ok()
        .filter(|bytes| bytes.len() == 32);
    bytes
        .map(|bytes| {
            let mut out = [0u8; 32];
            out.copy_from_slice(&bytes);
            out
        })
        .ok_or_else(|| {
            Error::invalid(format!(
                "tokens file: principal '{principal}': {field} must be 64 hex digits (a SHA-256)"
            ))
        })
}

impl Authenticator {
    /// Reads a tokens file.
    pub fn from_file(path: &Path) -> Result<Self> {
        Ok(Authenticator {
            known: std::sync::RwLock::new(Arc::new(Self::read(path)?)),
            path: Some(path.to_path_buf()),
        })
    }

    /// Parses the tokens file's JSON.
    pub fn from_json(text: &[u8]) -> Result<Self> {
        Ok(Authenticator {
            known: std::sync::RwLock::new(Arc::new(Self::parse(text)?)),
            path: None,
        })
    }

    /// Reads the tokens file again and, when it passes every check `serve` makes at start,
    /// takes its principals for the calls that come next (a call under way keeps the
    /// principal it was admitted as). A file that fails leaves the principals as they were.
    /// Answers how many principals there are now.
    pub fn reload(&self) -> Result<usize> {
        let path = self
            .path
            .as_deref()
            .ok_or_else(|| Error::invalid("these principals come from no file"))?;
        let fresh = Arc::new(Self::read(path)?);
        let count = fresh.len();
        *self
            .known
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = fresh;
        Ok(count)
    }

    /// The principals now.
    fn current(&self) -> Arc<Vec<Known>> {
        Arc::clone(
            &self
                .known
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    fn read(path: &Path) -> Result<Vec<Known>> {
        let text = std::fs::read(path)
            .map_err(|error| Error::io(format!("reading {}", path.display()), error))?;
        Self::parse(&text).map_err(|error| Error::invalid(format!("{}: {error}", path.display())))
    }

    fn parse(text: &[u8]) -> Result<Vec<Known>> {
        let file: TokensFile = serde_json::from_slice(text)
            .map_err(|error| Error::invalid(format!("tokens file: {error}")))?;
        let mut known = Vec::new();
        for entry in file.principals {
            if entry.name.trim().is_empty() {
                return Err(Error::invalid("tokens file: a principal without a name"));
            }
            if known.iter().any(|k: &Known| k.principal.name == entry.name) {
                return Err(Error::invalid(format!(
                    "tokens file: principal '{}' appears twice",
                    entry.name
                )));
            }
            let token = entry
                .token_sha256
                .as_deref()
                .map(|text| hash_field(&entry.name, "token_sha256", text))
                .transpose()?;
            let certificate = entry
                .certificate_sha256
                .as_deref()
                .map(|text| hash_field(&entry.name, "certificate_sha256", text))
                .transpose()?;
            if token.is_none() && certificate.is_none() {
                return Err(Error::invalid(format!(
                    "tokens file: principal '{}' needs token_sha256 or certificate_sha256",
                    entry.name
                )));
            }
            // Globs match schema and table apart since `*` stopped crossing the dot: one
            // without a dot would now grant nothing, silently.
            if let Some(glob) = entry
                .tables
                .iter()
                .chain(&entry.clear)
                .find(|glob| glob.as_str() != "*" && !glob.contains('.'))
            {
                return Err(Error::invalid(format!(
                    "tokens file: principal '{}': '{glob}' names no schema.table: `*` does not \
                     cross the dot between them, so write '{glob}.*' or 'dbo.{glob}' (or '*' \
                     for every table)",
                    entry.name
                )));
            }
            if let Some(hash) = &token
                && let Some(weak) = WEAK_TOKENS
                    .iter()
                    .find(|weak| sha256(weak.as_bytes()) == *hash)
            {
                return Err(Error::invalid(format!(
                    "tokens file: principal '{}': token_sha256 is the hash of {} (is the \
                     variable you hashed unset?); make a token with `openssl rand -hex 32`",
                    entry.name,
                    match weak.is_empty() {
                        true => "the empty string".to_string(),
                        false => format!("a well-known token ('{weak}')"),
                    }
                )));
            }
            let shared = known.iter().find(|other: &&Known| {
                (token.is_some() && other.token == token)
                    || (certificate.is_some() && other.certificate == certificate)
            });
            if let Some(other) = shared {
                return Err(Error::invalid(format!(
                    "tokens file: principals '{}' and '{}' share a token or certificate hash: \
                     a credential must name one principal",
                    other.principal.name, entry.name
                )));
            }
            known.push(Known {
                principal: Arc::new(Principal {
                    name: entry.name,
                    tables: entry.tables,
                    clear: entry.clear,
                    anonymous: false,
                }),
                token,
                certificate,
            });
        }
        if known.is_empty() {
            return Err(Error::invalid("tokens file: no principals"));
        }
        Ok(known)
    }

    /// The principal whose token is `token`. Every entry is compared, in constant time, so
    /// the time taken says nothing of which prefix matched.
    pub fn by_token(&self, token: &str) -> Option<Arc<Principal>> {
        let presented = sha256(token.as_bytes());
        let mut found = None;
        for known in self.current().iter() {
            if let Some(hash) = &known.token
                && same_hash(hash, &presented)
            {
                found = Some(Arc::clone(&known.principal));
            }
        }
        found
    }

    /// The principal of the client certificate `der` (mutual TLS).
    pub fn by_certificate(&self, der: &[u8]) -> Option<Arc<Principal>> {
        let presented = sha256(der);
        self.current()
            .iter()
            .find(|known| known.certificate.as_ref() == Some(&presented))
            .map(|known| Arc::clone(&known.principal))
    }

    /// The principal that a call's bearer token and client certificate name together. A
    /// principal pinned to both needs both: its token alone, or its certificate alone, is
    /// refused, and so are a token and a certificate of two principals.
    pub fn admit(
        &self,
        by_token: Option<Arc<Principal>>,
        by_certificate: Option<Arc<Principal>>,
    ) -> Result<Option<Arc<Principal>>> {
        let pinned = |principal: &Principal| {
            self.current()
                .iter()
                .find(|known| known.principal.name == principal.name)
                .map(|known| (known.token.is_some(), known.certificate.is_some()))
                .unwrap_or_default()
        };
        match (by_token, by_certificate) {
            (Some(token), Some(certificate)) if token.name != certificate.name => Err(
                unauthenticated("the bearer token and the client certificate name two principals"),
            ),
            (Some(token), Some(_)) => Ok(Some(token)),
            (Some(token), None) if pinned(&token).1 => Err(unauthenticated(
                "this principal is pinned to a client certificate too: present it with the token",
            )),
            (None, Some(certificate)) if pinned(&certificate).0 => Err(unauthenticated(
                "this principal is pinned to a bearer token too: send it with the certificate",
            )),
            (token, certificate) => Ok(token.or(certificate)),
        }
    }

    /// The principal of basic credentials: user = its name, password = its token.
    pub fn by_basic(&self, user: &str, password: &str) -> Option<Arc<Principal>> {
        self.by_token(password)
            .filter(|principal| principal.name == user)
    }
}

/// The credentials a call presents in its `authorization` header.
enum Presented {
    Bearer(String),
    Basic { user: String, password: String },
}

fn presented(metadata: &MetadataMap) -> Result<Option<Presented>> {
    let Some(value) = metadata.get("authorization") else {
        return Ok(None);
    };
    let value = value
        .to_str()
        .map_err(|_| unauthenticated("the authorization header is not text"))?;
    let (scheme, rest) = value.split_once(' ').unwrap_or((value, ""));
    if scheme.eq_ignore_ascii_case("bearer") {
        return Ok(Some(Presented::Bearer(rest.trim().to_string())));
    }
    if scheme.eq_ignore_ascii_case("basic") {
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(rest.trim())
            .ok()
            .and_then(|bytes| String::from_utf8(bytes).ok())
            .ok_or_else(|| unauthenticated("basic credentials are not base64 text"))?;
        let (user, password) = decoded
            .split_once(':')
            .ok_or_else(|| unauthenticated("basic credentials need user:password"))?;
        return Ok(Some(Presented::Basic {
            user: user.to_string(),
            password: password.to_string(),
        }));
    }
    Err(unauthenticated(
        "the authorization header must be Bearer or Basic",
    ))
}

fn unauthenticated(message: &str) -> Error {
    Error::Unauthenticated(message.into())
}

/// Basic credentials presented and verified, to be traded for the bearer token by
/// `handshake` only.
#[derive(Clone)]
pub struct BasicCredentials {
    /// Whose they are.
    pub principal: Arc<Principal>,
    /// The token (the password), sent back as the bearer token.
    pub token: String,
}

impl std::fmt::Debug for BasicCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BasicCredentials({}, <secret>)", self.principal.name)
    }
}

/// The interceptor every call passes: with `authenticator`, a bearer token or a client
/// certificate of a known principal, or basic credentials (for `handshake`); without one,
/// every caller is [`Principal::anonymous`].
pub fn interceptor(
    authenticator: Option<Arc<Authenticator>>,
    admissions: Option<Admissions>,
) -> impl Fn(Request<()>) -> std::result::Result<Request<()>, Status> + Clone {
    let refusals = Arc::new(super::refusals::RefusalLog::default());
    move |mut request: Request<()>| {
        let Some(authenticator) = &authenticator else {
            request
                .extensions_mut()
                .insert(Arc::new(Principal::anonymous()));
            return Ok(request);
        };
        let by_certificate = request
            .peer_certs()
            .and_then(|certs| certs.first().map(|leaf| leaf.as_ref().to_vec()))
            .and_then(|leaf| authenticator.by_certificate(&leaf));
        // Refusals go through the one error mapping, so they carry their reason code, and
        // are logged with their peer (at most once a minute per peer).
        let peer = request.remote_addr();
        let refuse = |error: Error| {
            refusals.refused(peer, &error.to_string());
            crate::status::to_status(&error)
        };
        let presented = presented(request.metadata()).map_err(refuse)?;
        if let Some(
            Presented::Bearer(token)
            | Presented::Basic {
                password: token, ..
            },
        ) = &presented
            && token.chars().count() < MIN_TOKEN_CHARS
        {
            return Err(refuse(unauthenticated(&format!(
                "the token is {}: tokens have at least {MIN_TOKEN_CHARS} characters (make one \
                 with `openssl rand -hex 32`)",
                match token.is_empty() {
                    true => "empty".to_string(),
                    false => "too short".to_string(),
                }
            ))));
        }
        let principal = match presented {
            Some(Presented::Bearer(token)) => {
                let by_token = authenticator.by_token(&token).ok_or_else(|| {
                    refuse(unauthenticated(
                        "the bearer token is not known to this server",
                    ))
                })?;
                authenticator
                    .admit(Some(by_token), by_certificate)
                    .map_err(refuse)?
            }
            Some(Presented::Basic { user, password }) => {
                let principal = authenticator
                    .by_basic(&user, &password)
                    .ok_or_else(|| refuse(unauthenticated("wrong user or token")))?;
                // A principal pinned to a certificate too needs it for the handshake as well.
                authenticator
                    .admit(Some(Arc::clone(&principal)), by_certificate.clone())
                    .map_err(refuse)?;
                request.extensions_mut().insert(BasicCredentials {
                    principal,
                    token: password,
                });
                // The handshake trades the basic login for the bearer token; other calls
                // need the token, with the certificate where the principal is pinned to both.
                authenticator
                    .admit(None, by_certificate)
                    .unwrap_or_default()
            }
            None => authenticator.admit(None, by_certificate).map_err(refuse)?,
        };
        match principal {
            Some(principal) => {
                request.extensions_mut().insert(principal);
            }
            // Refused on its headers, before its body is read: a caller without credentials
            // costs no request buffer. Basic credentials go on to the handshake.
            None if request.extensions().get::<BasicCredentials>().is_none() => {
                return Err(refuse(missing_credentials()));
            }
            None => {}
        }
        // Valid credentials: the connection may stay past its unauthenticated deadline.
        if let (Some(admissions), Some(peer)) = (&admissions, peer) {
            admissions.admit(peer);
        }
        Ok(request)
    }
}

/// The refusal of a call that presents no credentials.
fn missing_credentials() -> Error {
    Error::Unauthenticated(
        "this server needs credentials: an authorization: Bearer <token> header (or a \
         handshake with basic credentials), or a client certificate it knows"
            .into(),
    )
}

/// The caller of an intercepted request; `UNAUTHENTICATED` when it presented nothing valid.
pub fn principal_of<T>(request: &Request<T>) -> Result<Arc<Principal>> {
    request
        .extensions()
        .get::<Arc<Principal>>()
        .cloned()
        .ok_or_else(missing_credentials)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(text: &str) -> TableName {
        text.parse().expect("table name")
    }

    #[test]
    fn globs_match_whole_names_case_insensitively() {
        assert!(glob_matches("*", "dbo.orders"));
        assert!(glob_matches("dbo.*", "dbo.orders"));
        assert!(glob_matches("DBO.Order?", "dbo.orders"));
        assert!(glob_matches("*.ord*s", "sales.orders"));
        assert!(!glob_matches("dbo.*", "sales.orders"));
        assert!(!glob_matches("dbo.order", "dbo.orders"));
        assert!(!glob_matches("", "dbo.orders"));
        assert!(glob_matches("a*b*c*d", "axxbyyczzd"));
        assert!(!glob_matches("a*b*c*d", "axxbyyczz"));
        assert!(glob_matches("*.*", "sales.orders"));
        assert!(glob_matches("sales*.*", "sales_eu.orders"));
        assert!(
            !glob_matches("sales*", "sales_private.orders"),
            "no crossing the dot"
        );
        assert!(!glob_matches("*orders", "private.orders"));
        assert!(!glob_matches("sales?orders", "sales.orders"));
        assert!(
            !glob_matches("dbo.*", "dbo.x.y"),
            "a dot in the table part stays a dot"
        );
    }

    #[test]
    fn a_tokens_file_knows_its_principals_by_token_and_refuses_the_rest() {
        let json = format!(
            r#"{{"principals": [
                {{"name": "writer", "tables": ["*"], "token_sha256": "{}"}},
                {{"name": "analyst", "tables": ["sales.*"], "token_sha256": "{}"}}
            ]}}"#,
            hex::encode(sha256(b"writer-secret")),
            hex::encode(sha256(b"analyst-secret")),
        );
        let auth = Authenticator::from_json(json.as_bytes()).expect("valid file");
        let analyst = auth.by_token("analyst-secret").expect("known token");
        assert_eq!(analyst.name, "analyst");
        assert!(analyst.may_read(&table("sales.orders")));
        assert!(!analyst.may_read(&table("dbo.orders")));
        assert!(matches!(
            analyst.check(&table("dbo.orders")),
            Err(Error::NotAuthorized { .. })
        ));
        assert!(auth.by_token("wrong").is_none());
        assert!(auth.by_basic("writer", "writer-secret").is_some());
        assert!(auth.by_basic("analyst", "writer-secret").is_none());
    }

    #[test]
    fn a_principal_pinned_to_a_token_and_a_certificate_needs_both() {
        let json = format!(
            r#"{{"principals": [
                {{"name": "both", "tables": ["*"], "token_sha256": "{}",
                  "certificate_sha256": "{}"}},
                {{"name": "token", "tables": ["*"], "token_sha256": "{}"}},
                {{"name": "certificate", "tables": ["*"], "certificate_sha256": "{}"}}
            ]}}"#,
            hex::encode(sha256(b"both-secret-token")),
            hex::encode(sha256(b"both-certificate")),
            hex::encode(sha256(b"token-only-secret")),
            hex::encode(sha256(b"certificate-only")),
        );
        let auth = Authenticator::from_json(json.as_bytes()).expect("valid file");
        let token = |text: &str| auth.by_token(text);
        let certificate = |der: &[u8]| auth.by_certificate(der);
        let admitted = |by_token, by_certificate| {
            auth.admit(by_token, by_certificate)
                .map(|principal| principal.map(|principal| principal.name.clone()))
        };
        let both = admitted(token("both-secret-token"), certificate(b"both-certificate"));
        assert_eq!(both.expect("both presented"), Some("both".into()));
        let alone = admitted(token("both-secret-token"), None).expect_err("its token alone");
        assert!(
            alone.to_string().contains("client certificate too"),
            "{alone}"
        );
        let alone = admitted(None, certificate(b"both-certificate")).expect_err("its certificate");
        assert!(alone.to_string().contains("bearer token too"), "{alone}");
        let mixed = admitted(token("token-only-secret"), certificate(b"certificate-only"))
            .expect_err("two principals");
        assert!(mixed.to_string().contains("two principals"), "{mixed}");
        assert_eq!(
            admitted(token("token-only-secret"), None).expect("a token principal"),
            Some("token".into())
        );
        assert_eq!(
            admitted(None, certificate(b"certificate-only")).expect("a certificate principal"),
            Some("certificate".into())
        );
        assert_eq!(admitted(None, None).expect("nothing"), None);
    }

    #[test]
    fn a_bad_tokens_file_is_refused_with_the_reason() {
        for (json, expected) in [
            (r#"{"principals": []}"#, "no principals"),
            (
                r#"{"principals": [{"name": "a", "tables": []}]}"#,
                "needs token_sha256",
            ),
            (
                r#"{"principals": [{"name": "a", "tables": [], "token_sha256": "abc"}]}"#,
                "64 hex digits",
            ),
            (r#"{"principal": []}"#, "unknown field"),
            (
                r#"{"principals": [{"name": "a", "tables": ["sales*"], "token_sha256": "0101010101010101010101010101010101010101010101010101010101010101"}]}"#,
                "'sales*' names no schema.table",
            ),
            (
                // SHA-256 of the empty string: `printf %s "$TOKEN" | sha256sum`, TOKEN unset.
                r#"{"principals": [{"name": "a", "tables": [], "token_sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}]}"#,
                "the empty string",
            ),
            (
                // SHA-256 of "test", the old docs' example.
                r#"{"principals": [{"name": "a", "tables": [], "token_sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"}]}"#,
                "well-known token ('test')",
            ),
            (
                r#"{"principals": [
                    {"name": "a", "tables": [], "token_sha256": "0101010101010101010101010101010101010101010101010101010101010101"},
                    {"name": "b", "tables": [], "token_sha256": "0101010101010101010101010101010101010101010101010101010101010101"}
                ]}"#,
                "principals 'a' and 'b' share",
            ),
        ] {
            let error = Authenticator::from_json(json.as_bytes()).expect_err(json);
            assert!(error.to_string().contains(expected), "{json}: {error}");
        }
    }
}
