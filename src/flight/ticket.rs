//! Self-contained, versioned, signed tickets.
//!
//! A ticket carries everything a `do_get` needs (table, capture instance, the LSN range,
//! the output columns with their types, batch bounds), so any replica holding the ticket
//! key can redeem it and no server state is needed between planning and reading. The bytes
//! are `[version: 1 byte][TicketBody as protobuf][HMAC-SHA256 of the two, 32 bytes]`; the
//! protobuf messages are those of `proto/mssql_cdc_flight.proto`. A ticket edited by a
//! client, or signed with another key, is refused.

use ring::hmac;

use crate::error::{Error, Result};

/// The ticket format this build writes and reads.
pub const TICKET_VERSION: u8 = 1;
const SIGNATURE_LEN: usize = 32;

/// One output column of a ticket (`TicketColumn`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TicketColumn {
    /// Column name.
    #[prost(string, tag = "1")]
    pub name: String,
    /// SQL Server type the column is served as (`decimal(18,4)`, ...).
    #[prost(string, tag = "2")]
    pub sql_type: String,
}

impl TicketColumn {
    /// The ticket form of an output column.
    pub fn of(column: &crate::types::OutputColumn) -> Self {
        TicketColumn {
            name: column.name.clone(),
            sql_type: column.sql_type.to_string(),
        }
    }

    /// The output columns a ticket names; a type that does not parse is a malformed ticket.
    pub fn to_output(columns: &[TicketColumn]) -> Result<Vec<crate::types::OutputColumn>> {
        columns
            .iter()
            .map(|column| {
                Ok(crate::types::OutputColumn {
                    name: column.name.clone(),
                    sql_type: column.sql_type.parse().map_err(
                        |error: crate::types::SqlTypeParseError| {
                            Error::TicketMalformed(error.to_string())
                        },
                    )?,
                })
            })
            .collect()
    }
}

/// A change range to read (`ChangeRangeTicket`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ChangeRangeTicket {
    /// Source table, `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
    /// Capture instance to read.
    #[prost(string, tag = "2")]
    pub capture_instance: String,
    /// First commit LSN read (inclusive), 10 bytes.
    #[prost(bytes = "vec", tag = "3")]
    pub from_lsn: Vec<u8>,
    /// Last commit LSN read (inclusive), 10 bytes.
    #[prost(bytes = "vec", tag = "4")]
    pub to_lsn: Vec<u8>,
    /// Output columns after the metadata columns.
    #[prost(message, repeated, tag = "5")]
    pub columns: Vec<TicketColumn>,
    /// Whether `_command_id` is served.
    #[prost(bool, tag = "6")]
    pub include_command_id: bool,
    /// Most rows per batch.
    #[prost(uint64, tag = "7")]
    pub batch_rows: u64,
    /// Most bytes per batch.
    #[prost(uint64, tag = "8")]
    pub batch_bytes: u64,
    /// IPC compression: 0 none, 1 LZ4 frame, 2 ZSTD.
    #[prost(uint32, tag = "9")]
    pub compression: u32,
    /// Rows the plan counted in the range (informational; the marker has the real count).
    #[prost(uint64, tag = "10")]
    pub planned_rows: u64,
}

/// One key range of a snapshot ticket (`SnapshotPieceTicket`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotPieceTicket {
    /// Chunk number (`_chunk`); absent in a full snapshot.
    #[prost(int32, optional, tag = "1")]
    pub chunk: Option<i32>,
    /// First key (inclusive); absent: unbounded.
    #[prost(sint64, optional, tag = "2")]
    pub lo: Option<i64>,
    /// First key after the range; absent: unbounded.
    #[prost(sint64, optional, tag = "3")]
    pub hi: Option<i64>,
    /// Keyset lower bound (inclusive), a JSON array, on the ticket's `keys`.
    #[prost(string, optional, tag = "4")]
    pub keyset_lo: Option<String>,
    /// Keyset upper bound (exclusive), a JSON array.
    #[prost(string, optional, tag = "5")]
    pub keyset_hi: Option<String>,
}

/// A snapshot read (`SnapshotTicket`): the stamp is recorded when the ticket is redeemed.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotTicket {
    /// Source table, `schema.table`.
    #[prost(string, tag = "1")]
    pub table: String,
    /// Capture instance the rows are served for.
    #[prost(string, tag = "2")]
    pub capture_instance: String,
    /// Output columns after the metadata columns.
    #[prost(message, repeated, tag = "3")]
    pub columns: Vec<TicketColumn>,
    /// Key ranges, read in order.
    #[prost(message, repeated, tag = "4")]
    pub pieces: Vec<SnapshotPieceTicket>,
    /// Whether `_command_id` is served.
    #[prost(bool, tag = "5")]
    pub include_command_id: bool,
    /// Most rows per batch.
    #[prost(uint64, tag = "6")]
    pub batch_rows: u64,
    /// IPC compression: 0 none, 1 LZ4 frame, 2 ZSTD.
    #[prost(uint32, tag = "7")]
    pub compression: u32,
    /// The columns keyset pieces are cut on; empty: every piece is an integer range.
    #[prost(message, repeated, tag = "8")]
    pub keys: Vec<TicketColumn>,
}

/// What a ticket reads (`TicketBody.kind`).
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum TicketKind {
    /// A change range of one capture instance.
    #[prost(message, tag = "1")]
    ChangeRange(ChangeRangeTicket),
    /// Current rows of a table.
    #[prost(message, tag = "2")]
    Snapshot(SnapshotTicket),
}

/// The signed part of a ticket (`TicketBody`).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TicketBody {
    /// What to read.
    #[prost(oneof = "TicketKind", tags = "1, 2")]
    pub kind: Option<TicketKind>,
}

/// Signs and verifies tickets with one HMAC-SHA256 key.
#[derive(Clone)]
pub struct TicketSigner {
    key: hmac::Key,
}

impl std::fmt::Debug for TicketSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketSigner(<secret>)")
    }
}

impl TicketSigner {
    /// A signer with this secret (at least 16 bytes).
    pub fn new(secret: &[u8]) -> Result<Self> {
        if secret.len() < 16 {
            return Err(Error::invalid("the ticket key needs at least 16 bytes"));
        }
        Ok(TicketSigner {
            key: hmac::Key::new(hmac::HMAC_SHA256, secret),
        })
    }

    /// A signer with a fresh random key: tickets are then redeemable by this process only.
    pub fn random() -> Result<Self> {
        let rng = ring::rand::SystemRandom::new();
        let key = hmac::Key::generate(hmac::HMAC_SHA256, &rng)
            .map_err(|_| Error::Internal("the system random generator failed".into()))?;
        Ok(TicketSigner { key })
    }

    /// The ticket bytes for `body`.
    pub fn sign(&self, body: &TicketBody) -> Vec<u8> {
        let mut bytes = vec![TICKET_VERSION];
        prost::Message::encode(body, &mut bytes).expect("encoding into a Vec cannot fail");
        let tag = hmac::sign(&self.key, &bytes);
        bytes.extend_from_slice(tag.as_ref());
        bytes
    }

    /// The body of a ticket this key signed.
    pub fn verify(&self, ticket: &[u8]) -> Result<TicketBody> {
        if ticket.len() < 1 + SIGNATURE_LEN {
            return Err(Error::TicketMalformed(format!(
                "{} bytes is too short",
                ticket.len()
            )));
        }
        let (signed, signature) = ticket.split_at(ticket.len() - SIGNATURE_LEN);
        hmac::verify(&self.key, signed, signature).map_err(|_| Error::TicketForged)?;
        if signed[0] != TICKET_VERSION {
            return Err(Error::TicketMalformed(format!(
                "version {} is not supported (this server reads version {TICKET_VERSION})",
                signed[0]
            )));
        }
        let body: TicketBody = prost::Message::decode(&signed[1..])
            .map_err(|error| Error::TicketMalformed(error.to_string()))?;
        if body.kind.is_none() {
            return Err(Error::TicketMalformed("it names nothing to read".into()));
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
                }],
                include_command_id: true,
                batch_rows: 10,
                batch_bytes: 100,
                compression: 0,
                planned_rows: 3,
            })),
        }
    }

    #[test]
    fn a_signed_ticket_verifies_and_round_trips() {
        let signer = TicketSigner::new(b"0123456789abcdef0123").expect("key");
        let ticket = signer.sign(&body());
        assert_eq!(signer.verify(&ticket).expect("valid"), body());
    }

    #[test]
    fn any_edited_byte_is_refused() {
        let signer = TicketSigner::new(b"0123456789abcdef0123").expect("key");
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
        let signer = TicketSigner::new(b"0123456789abcdef0123").expect("key");
        let other = TicketSigner::random().expect("random key");
        assert!(matches!(
            other.verify(&signer.sign(&body())),
            Err(Error::TicketForged)
        ));
        assert!(TicketSigner::new(b"short").is_err());
    }
}
