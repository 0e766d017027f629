//! Self-contained, versioned, signed tickets.
//!
//! A ticket carries everything a `do_get` needs (table, capture instance, the LSN range,
//! the output columns with their types, batch bounds), so any replica holding the ticket
//! key can redeem it and no server state is needed between planning and reading. The bytes
//! are `[version: 1 byte][TicketBody as protobuf][HMAC-SHA256 of the two, 32 bytes]`; the
//! protobuf messages are those of `proto/mssql_cdc_flight.proto`, generated in the contract
//! crate ([`mssql_cdc_proto::ticket`]). A ticket edited by a client, or signed with another
//! key, is refused.

use ring::hmac;

use crate::error::{Error, Result};
pub use mssql_cdc_proto::ticket::{
    ChangeRangeTicket, SnapshotPieceTicket, SnapshotTicket, TicketBody, TicketColumn, TicketKind,
};

/// The ticket format this build writes and reads.
pub const TICKET_VERSION: u8 = 1;
const SIGNATURE_LEN: usize = 32;

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
