//! The one mapping from [`Error`] to gRPC statuses.
//!
//! Exhaustive on purpose (no catch-all arm): a new error variant does not compile until
//! someone decides what a client sees for it. Every status carries gRPC's rich error details
//! (`google.rpc.ErrorInfo` in `grpc-status-details-bin`): a stable `reason` code, the domain
//! [`ERROR_DOMAIN`] and the error's fields, so a client branches on the reason instead of
//! parsing the message; [`Busy`](Error::Busy) adds a `RetryInfo` with its delay.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::error::Error;

/// The `domain` of every `ErrorInfo` this service sends.
pub const ERROR_DOMAIN: &str = "mssql-cdc-flight";

/// The gRPC code a client receives for `error`.
pub fn code_of(error: &Error) -> Code {
    match error {
        Error::ChangesPurged { .. } | Error::PurgedDuringRead { .. } => Code::DataLoss,
        Error::TableNotFound { .. } | Error::CaptureInstanceNotFound { .. } => Code::NotFound,
        Error::InvalidArgument(_) | Error::TicketMalformed(_) => Code::InvalidArgument,
        Error::SchemaChanged(_)
        | Error::TicketExpired { .. }
        | Error::TicketMasksChanged(_)
        | Error::GrantMissing(_) => Code::FailedPrecondition,
        Error::TicketForged | Error::NotAuthorized { .. } | Error::Masked(_) => {
            Code::PermissionDenied
        }
        Error::Unauthenticated(_) => Code::Unauthenticated,
        Error::Busy { .. } => Code::ResourceExhausted,
        Error::DeadlineExceeded(_) | Error::StreamStalled(_) => Code::DeadlineExceeded,
        Error::SourceUnavailable(_) => Code::Unavailable,
        Error::Io { .. } | Error::Arrow(_) | Error::Internal(_) => Code::Internal,
    }
}

/// The stable reason code of `error` (`ErrorInfo.reason`), one per cause; docs/protocol.md
/// lists them.
pub fn reason_of(error: &Error) -> &'static str {
    match error {
        Error::ChangesPurged { .. } => "CHANGES_PURGED",
        Error::PurgedDuringRead { .. } => "PURGED_DURING_READ",
        Error::TableNotFound { .. } => "TABLE_NOT_FOUND",
        Error::CaptureInstanceNotFound { .. } => "CAPTURE_INSTANCE_NOT_FOUND",
        Error::InvalidArgument(_) => "INVALID_REQUEST",
        Error::TicketMalformed(_) => "TICKET_MALFORMED",
        Error::SchemaChanged(_) => "SCHEMA_CHANGED",
        Error::TicketExpired { .. } => "TICKET_EXPIRED",
        Error::TicketMasksChanged(_) => "TICKET_MASKS_CHANGED",
        Error::GrantMissing(_) => "SOURCE_GRANT_MISSING",
        Error::TicketForged => "TICKET_FORGED",
        Error::NotAuthorized { .. } => "TABLE_NOT_GRANTED",
        Error::Masked(_) => "COLUMN_MASKED",
        Error::Unauthenticated(_) => "UNAUTHENTICATED",
        Error::Busy { .. } => "SERVER_BUSY",
        Error::DeadlineExceeded(_) => "DEADLINE_EXCEEDED",
        Error::StreamStalled(_) => "STREAM_STALLED",
        Error::SourceUnavailable(_) => "SOURCE_UNAVAILABLE",
        Error::Io { .. } => "LOCAL_IO",
        Error::Arrow(_) => "ARROW",
        Error::Internal(_) => "INTERNAL",
    }
}

/// The fields of `error` a client may act on (`ErrorInfo.metadata`).
fn fields_of(error: &Error) -> HashMap<String, String> {
    let pairs: Vec<(&str, String)> = match error {
        Error::ChangesPurged {
            capture_instance,
            requested,
            min_lsn,
            ..
        } => vec![
            ("capture_instance", capture_instance.clone()),
            ("requested_lsn", requested.to_string()),
            ("min_lsn", min_lsn.to_string()),
        ],
        Error::PurgedDuringRead {
            capture_instance,
            from,
            min_lsn,
        } => vec![
            ("capture_instance", capture_instance.clone()),
            ("requested_lsn", from.to_string()),
            ("min_lsn", min_lsn.to_string()),
        ],
        Error::TableNotFound { table } => vec![("table", table.clone())],
        Error::CaptureInstanceNotFound { name, .. } => vec![("capture_instance", name.clone())],
        Error::TicketExpired { expired_at } => vec![("expired_at", expired_at.to_string())],
        Error::NotAuthorized { principal, table } => {
            vec![("principal", principal.clone()), ("table", table.clone())]
        }
        Error::Busy {
            retry_after_seconds,
            ..
        } => vec![("retry_after_seconds", retry_after_seconds.to_string())],
        _ => Vec::new(),
    };
    pairs
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect()
}

/// The status a client receives for `error`, logged at the level its kind deserves: server
/// faults at error, the source's trouble at warn, what the client caused at debug.
pub fn to_status(error: &Error) -> Status {
    let code = code_of(error);
    match code {
        Code::DataLoss => tracing::error!(%error, "data loss"),
        Code::Internal => tracing::error!(%error, "internal error"),
        Code::Unavailable => tracing::warn!(%error, "source unavailable"),
        Code::FailedPrecondition if matches!(error, Error::GrantMissing(_)) => {
            tracing::warn!(%error, "the source refuses the server's login")
        }
        _ => tracing::debug!(%error, ?code, "request refused"),
    }
    let mut details = ErrorDetails::new();
    details.set_error_info(reason_of(error), ERROR_DOMAIN, fields_of(error));
    if let Error::Busy {
        retry_after_seconds,
        ..
    } = error
    {
        details.set_retry_info(Some(Duration::from_secs(*retry_after_seconds)));
    }
    Status::with_error_details(code, error.to_string(), details)
}

/// The reason code of a status this service sent (`ErrorInfo.reason`), if it carries one.
pub fn reason_of_status(status: &Status) -> Option<String> {
    status
        .get_details_error_info()
        .filter(|info| info.domain == ERROR_DOMAIN)
        .map(|info| info.reason)
}

impl From<Error> for Status {
    fn from(error: Error) -> Self {
        to_status(&error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lsn::Lsn;

    #[test]
    fn purges_are_data_loss_with_the_lsns_in_the_message_and_the_details() {
        let status = to_status(&Error::ChangesPurged {
            capture_instance: "dbo_orders".into(),
            requested: Lsn::ZERO.increment(),
            min_lsn: Lsn::MAX,
            hint: String::new(),
        });
        assert_eq!(status.code(), Code::DataLoss);
        assert!(status.message().contains("dbo_orders"));
        assert!(status.message().contains("0x00000000000000000001"));
        assert!(status.message().contains("0xFFFFFFFFFFFFFFFFFFFF"));
        let info = status.get_details_error_info().expect("error info");
        assert_eq!(info.reason, "CHANGES_PURGED");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(info.metadata["min_lsn"], "0xFFFFFFFFFFFFFFFFFFFF");
        assert_eq!(info.metadata["requested_lsn"], "0x00000000000000000001");
    }

    #[test]
    fn each_kind_has_its_code() {
        assert_eq!(code_of(&Error::TicketForged), Code::PermissionDenied);
        assert_eq!(code_of(&Error::invalid("x")), Code::InvalidArgument);
        assert_eq!(
            code_of(&Error::TableNotFound { table: "t".into() }),
            Code::NotFound
        );
        assert_eq!(
            code_of(&Error::SourceUnavailable("x".into())),
            Code::Unavailable
        );
        assert_eq!(
            code_of(&Error::SchemaChanged("x".into())),
            Code::FailedPrecondition
        );
        assert_eq!(
            code_of(&Error::GrantMissing("x".into())),
            Code::FailedPrecondition
        );
        assert_eq!(
            code_of(&Error::TicketExpired { expired_at: 1 }),
            Code::FailedPrecondition
        );
        assert_eq!(
            code_of(&Error::Unauthenticated("x".into())),
            Code::Unauthenticated
        );
    }

    #[test]
    fn a_busy_server_says_when_to_retry() {
        let status = to_status(&Error::Busy {
            what: "64 streams are open".into(),
            retry_after_seconds: 2,
        });
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status.get_details_retry_info().and_then(|r| r.retry_delay),
            Some(Duration::from_secs(2))
        );
        assert_eq!(reason_of_status(&status).as_deref(), Some("SERVER_BUSY"));
    }
}
