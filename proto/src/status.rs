//! The one mapping from [`Error`] to gRPC status codes.
//!
//! Exhaustive on purpose (no catch-all arm): a new error variant does not compile until
//! someone decides what a client sees for it.

use tonic::{Code, Status};

use crate::error::Error;

/// The gRPC code a client receives for `error`.
pub fn code_of(error: &Error) -> Code {
    match error {
        Error::ChangesPurged { .. } | Error::PurgedDuringRead { .. } => Code::DataLoss,
        Error::TableNotFound { .. } | Error::CaptureInstanceNotFound { .. } => Code::NotFound,
        Error::InvalidArgument(_) | Error::TicketMalformed(_) => Code::InvalidArgument,
        Error::SchemaChanged(_) => Code::FailedPrecondition,
        Error::TicketForged | Error::PermissionDenied(_) => Code::PermissionDenied,
        Error::SourceUnavailable(_) => Code::Unavailable,
        Error::Io { .. } | Error::Arrow(_) | Error::Internal(_) => Code::Internal,
    }
}

/// The status a client receives for `error`, logged at the level its kind deserves.
pub fn to_status(error: &Error) -> Status {
    let code = code_of(error);
    match code {
        Code::DataLoss => tracing::error!(%error, "data loss"),
        Code::Internal => tracing::error!(%error, "internal error"),
        Code::Unavailable => tracing::warn!(%error, "source unavailable"),
        _ => tracing::debug!(%error, ?code, "request refused"),
    }
    Status::new(code, error.to_string())
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
    fn purges_are_data_loss_with_the_lsns_in_the_message() {
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
    }
}
