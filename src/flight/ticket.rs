//! Self-contained, versioned, signed tickets that expire.
//!
//! A ticket carries everything a `do_get` needs (table, capture instance, the LSN range,
//! the output columns with their types, batch bounds, its expiry), so any replica holding the
//! ticket key can redeem it and no server state is needed between planning and reading. The
//! bytes are `[version: 1 byte][key id: 4 bytes][TicketBody as protobuf][HMAC-SHA256 of all
//! before it, 32 bytes]`; the protobuf messages are those of `proto/mssql_cdc_flight.proto`,
//! generated in the contract crate ([`mssql_cdc_proto::ticket`]). The key id (the first 4
//! bytes of the key's SHA-256) picks the verifying key, so a key file may hold several keys:
//! the first signs, all verify, and a key is rotated without breaking the plans in flight. A
//! ticket edited by a client, or signed with a key this server lacks, is refused; an expired
//! one asks for a new plan.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::hmac;

use crate::error::{Error, Result};
pub use mssql_cdc_proto::ticket::{
    ChangeRangeTicket, SnapshotPieceTicket, SnapshotTicket, TicketBody, TicketColumn, TicketKind,
};

/// A ticket's batch bound (rows or bytes) as a `usize`, one at least.
pub fn batch_bound(value: u64) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX).max(1)
}

/// The ticket format this build writes and reads.
pub const TICKET_VERSION: u8 = 2;
const KEY_ID_LEN: usize = 4;
const SIGNATURE_LEN: usize = 32;
/// How long a ticket stays redeemable by default.
pub const DEFAULT_TICKET_LIFETIME: Duration = Duration::from_secs(24 * 3600);
/// The shortest key accepted: 32 bytes, as many as HMAC-SHA256's output, so a key made
/// by `openssl rand -hex 32` (or drawn at start) is never the weak part.
const MIN_KEY_LEN: usize = 32;

struct TicketKey {
    id: [u8; KEY_ID_LEN],
    key: hmac::Key,
}

impl TicketKey {
    fn new(secret: &[u8]) -> Result<Self> {
        if secret.len() < MIN_KEY_LEN {
            return Err(Error::invalid(format!(
                "a ticket key needs at least {MIN_KEY_LEN} bytes"
            )));
        }
        let hash = crate::flight::auth::sha256(secret);
        let mut id = [0u8; KEY_ID_LEN];
        id.copy_from_slice(&hash[..KEY_ID_LEN]);
        Ok(TicketKey {
            id,
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        })
    }
}

/// Signs tickets with its first key and verifies them with any of its keys.
pub struct TicketSigner {
    keys: Vec<TicketKey>,
    lifetime: Duration,
    random: bool,
}

impl Clone for TicketSigner {
    fn clone(&self) -> Self {
        TicketSigner {
            keys: self
                .keys
                .iter()
                .map(|key| TicketKey {
                    id: key.id,
                    key: key.key.clone(),
                })
                .collect(),
            lifetime: self.lifetime,
            random: self.random,
        }
    }
}

impl std::fmt::Debug for TicketSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TicketSigner({} keys, <secret>)", self.keys.len())
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

impl TicketSigner {
    /// A signer with this secret (at least 32 bytes).
    pub fn new(secret: &[u8]) -> Result<Self> {
        Self::with_keys(&[secret])
    }

    /// A signer whose first secret signs and all verify.
    pub fn with_keys(secrets: &[&[u8]]) -> Result<Self> {
        if secrets.is_empty() {
            return Err(Error::invalid("a ticket key file needs at least one key"));
        }
        Ok(TicketSigner {
            keys: secrets
                .iter()
                .map(|secret| TicketKey::new(secret))
                .collect::<Result<_>>()?,
            lifetime: DEFAULT_TICKET_LIFETIME,
            random: false,
        })
    }

    /// A signer with a fresh random key: tickets are then redeemable by this process only.
    pub fn random() -> Result<Self> {
        let rng = ring::rand::SystemRandom::new();
        let secret: [u8; 32] = ring::rand::generate(&rng)
            .map_err(|_| Error::Internal("the system random generator failed".into()))?
            .expose();
        let mut signer = Self::new(&secret)?;
        signer.random = true;
        Ok(signer)
    }

    /// Reads a key file: text holds one key per line (64 hex digits, or at least 32 bytes of
    /// text, which is warned about: a passphrase can be guessed offline by anyone holding a
    /// ticket; blank lines and `#` comments skipped), anything that is not UTF-8 is one
    /// binary key read as bytes.
    pub fn from_key_file(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path)
            .map_err(|error| Error::io(format!("reading ticket key {}", path.display()), error))?;
        Self::from_key_bytes(&bytes)
            .map_err(|error| Error::invalid(format!("{}: {error}", path.display())))
    }

    /// Parses the bytes of a key file (see [`TicketSigner::from_key_file`]).
    pub fn from_key_bytes(bytes: &[u8]) -> Result<Self> {
        let Ok(text) = std::str::from_utf8(bytes) else {
            return Self::new(bytes);
        };
        let secrets: Vec<Vec<u8>> = text
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(|line| match hex::decode(line) {
                Ok(key) if line.len() == 64 => key,
                _ => {
                    tracing::warn!(
                        "a ticket key given as text, not as 64 hex digits: anyone holding a \
                         ticket can test guesses of a passphrase offline; make a key with \
                         `openssl rand -hex 32`"
                    );
                    line.as_bytes().to_vec()
                }
            })
            .collect();
        let secrets: Vec<&[u8]> = secrets.iter().map(Vec::as_slice).collect();
        Self::with_keys(&secrets)
    }

    /// This signer with tickets redeemable for `lifetime` after they are signed.
    pub fn with_lifetime(mut self, lifetime: Duration) -> Self {
        self.lifetime = lifetime;
        self
    }

    /// Whether the key is random to this process (replicas cannot redeem its tickets).
    pub fn is_random(&self) -> bool {
        self.random
    }

    /// The ticket bytes for `body`, expiring after the signer's lifetime.
    pub fn sign(&self, body: &TicketBody) -> Vec<u8> {
        let mut body = body.clone();
        body.expires_at = now_unix().saturating_add(self.lifetime.as_secs());
        self.sign_as_is(&body)
    }

    /// The ticket bytes for `body` with its own `expires_at`.
    fn sign_as_is(&self, body: &TicketBody) -> Vec<u8> {
        let key = &self.keys[0];
        let mut bytes = vec![TICKET_VERSION];
        bytes.extend_from_slice(&key.id);
        prost::Message::encode(body, &mut bytes).expect("encoding into a Vec cannot fail");
        let tag = hmac::sign(&key.key, &bytes);
        bytes.extend_from_slice(tag.as_ref());
        bytes
    }

    /// The body of a ticket one of these keys signed, not expired.
    pub fn verify(&self, ticket: &[u8]) -> Result<TicketBody> {
        let header = 1 + KEY_ID_LEN;
        if ticket.len() < header + SIGNATURE_LEN {
            return Err(Error::TicketMalformed(format!(
                "{} bytes is too short",
                ticket.len()
            )));
        }
        let (signed, signature) = ticket.split_at(ticket.len() - SIGNATURE_LEN);
        // The id is not trusted: it only picks the key, and the signature covers it.
        let key = self
            .keys
            .iter()
            .find(|key| key.id[..] == signed[1..header])
            .ok_or(Error::TicketForged)?;
        hmac::verify(&key.key, signed, signature).map_err(|_| Error::TicketForged)?;
        if signed[0] != TICKET_VERSION {
            return Err(Error::TicketMalformed(format!(
                "version {} is not supported (this server reads version {TICKET_VERSION})",
                signed[0]
            )));
        }
        let body: TicketBody = prost::Message::decode(&signed[header..])
            .map_err(|error| Error::TicketMalformed(error.to_string()))?;
        if body.kind.is_none() {
            return Err(Error::TicketMalformed("it names nothing to read".into()));
        }
        if body.expires_at <= now_unix() {
            return Err(Error::TicketExpired {
                expired_at: body.expires_at,
            });
        }
        Ok(body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body() -> TicketBody {
        TicketBody {
            kind: Some(TicketKind::ChangeRange(ChangeRangeTicket {
                table: "dbo.orders".into(),
                capture_instance: "dbo_orders".into(),
                from_lsn: vec![0; 10],
                to_lsn: vec![1; 10],
                columns: vec![TicketColumn {
                    name: "order_id".into(),
                    sql_type: "bigint".into(),
                    mask: String::new(),
                }],
                include_command_id: true,
                batch_rows: 10,
                batch_bytes: 100,
                compression: 0,
                planned_rows: 3,
            })),
            expires_at: 0,
        }
    }

    fn same_read(left: &TicketBody, right: &TicketBody) -> bool {
        left.kind == right.kind
    }

    #[test]
    fn a_signed_ticket_verifies_and_round_trips() {
        let signer = TicketSigner::new(b"0123456789abcdef0123456789abcdef").expect("key");
        let verified = signer.verify(&signer.sign(&body())).expect("valid");
        assert!(same_read(&verified, &body()));
        assert!(verified.expires_at >= now_unix() + DEFAULT_TICKET_LIFETIME.as_secs() - 5);
    }

    #[test]
    fn any_edited_byte_is_refused() {
        let signer = TicketSigner::new(b"0123456789abcdef0123456789abcdef").expect("key");
        let ticket = signer.sign(&body());
        for index in 0..ticket.len() {
            let mut edited = ticket.clone();
            edited[index] ^= 0x01;
            assert!(
                matches!(signer.verify(&edited), Err(Error::TicketForged)),
                "byte {index} edited"
            );
        }
        assert!(matches!(
            signer.verify(&ticket[..5]),
            Err(Error::TicketMalformed(_))
        ));
    }

    #[test]
    fn another_key_is_refused_and_short_keys_are_too() {
        let signer = TicketSigner::new(b"0123456789abcdef0123456789abcdef").expect("key");
        let other = TicketSigner::random().expect("random key");
        assert!(matches!(
            other.verify(&signer.sign(&body())),
            Err(Error::TicketForged)
        ));
        assert!(TicketSigner::new(b"short").is_err());
    }

    #[test]
    fn an_expired_ticket_asks_for_a_new_plan() {
        let signer = TicketSigner::new(b"0123456789abcdef0123456789abcdef").expect("key");
        let mut expired = body();
        expired.expires_at = now_unix() - 1;
        assert!(matches!(
            signer.verify(&signer.sign_as_is(&expired)),
            Err(Error::TicketExpired { .. })
        ));
        let instant = signer.clone().with_lifetime(Duration::ZERO);
        assert!(matches!(
            instant.verify(&instant.sign(&body())),
            Err(Error::TicketExpired { .. })
        ));
    }

    #[test]
    fn a_rotated_key_file_still_verifies_the_old_keys_tickets() {
        let old =
            TicketSigner::from_key_bytes(b"the old key of the fleet, rotated out\n").expect("old");
        let rotated = TicketSigner::from_key_bytes(
            b"# new key first, the old one verifies what is in flight\n\
              the new key of the fleet, signing now\n\nthe old key of the fleet, rotated out\n",
        )
        .expect("rotated");
        let in_flight = old.sign(&body());
        assert!(rotated.verify(&in_flight).is_ok());
        assert!(matches!(
            old.verify(&rotated.sign(&body())),
            Err(Error::TicketForged)
        ));
        let hex_key = format!("{}\n", "ab".repeat(32));
        let from_hex = TicketSigner::from_key_bytes(hex_key.as_bytes()).expect("hex key");
        assert!(
            TicketSigner::new(&[0xab; 32])
                .expect("bytes")
                .verify(&from_hex.sign(&body()))
                .is_ok()
        );
    }

    #[test]
    fn a_binary_key_file_is_read_as_bytes() {
        let binary: Vec<u8> = (0..32u8).map(|byte| byte.wrapping_mul(37) | 0x80).collect();
        assert!(std::str::from_utf8(&binary).is_err());
        let from_file = TicketSigner::from_key_bytes(&binary).expect("binary key");
        let direct = TicketSigner::new(&binary).expect("key");
        assert!(direct.verify(&from_file.sign(&body())).is_ok());
    }
}
