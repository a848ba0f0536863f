//! Error reports in PostgreSQL's style: lowercase message, DETAIL and HINT as sentences.

use ccm_codec::{DecodeError, DecodeErrorKind};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// Message of the error raised while CCM is off; Aurora's exact text.
pub const CCM_DISABLED: &str = "Cluster Cache Manager is disabled";

/// Raises an ERROR with optional detail and hint. Never returns.
pub fn raise(code: PgSqlErrorCode, message: String, detail: Option<String>, hint: Option<&str>) -> ! {
    let mut report = ErrorReport::new(code, message, "pg_ccm");
    if let Some(detail) = detail {
        report = report.set_detail(detail);
    }
    if let Some(hint) = hint {
        report = report.set_hint(hint);
    }
    report.report(PgLogLevel::ERROR);
    unreachable!("ereport(ERROR) returned")
}

/// Raises Aurora's error unless `ccm.enabled` is on.
pub fn require_enabled() {
    if !crate::gucs::ENABLED.get() {
        raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            CCM_DISABLED.to_string(),
            None,
            Some("Set ccm.enabled = on and reload the configuration."),
        );
    }
}

/// Turns a codec error ("a lowercase fragment") into a DETAIL sentence.
fn sentence(fragment: &str) -> String {
    let mut chars = fragment.chars();
    match chars.next() {
        Some(first) => format!("{}{}.", first.to_uppercase(), chars.as_str()),
        None => String::new(),
    }
}

/// Raises the ERROR for malformed `what` ("filter" or "block list") input.
pub fn invalid_input(what: &str, error: &DecodeError) -> ! {
    let hint = match error.kind() {
        DecodeErrorKind::UnsupportedVersion => {
            Some("Both nodes must run the same pg_ccm version; update the extension everywhere.")
        }
        DecodeErrorKind::BadMagic => Some(match what {
            "filter" => "Pass the output of ccm_buffer_filter().",
            _ => "Pass the output of ccm_hot_blocks().",
        }),
        _ => None,
    };
    raise(
        PgSqlErrorCode::ERRCODE_INVALID_BINARY_REPRESENTATION,
        format!("invalid pg_ccm {what}"),
        Some(sentence(&error.to_string())),
        hint,
    )
}

/// Raises ERRCODE_INVALID_PARAMETER_VALUE for a bad argument.
pub fn invalid_argument(message: String, detail: Option<String>) -> ! {
    raise(PgSqlErrorCode::ERRCODE_INVALID_PARAMETER_VALUE, message, detail, None)
}
