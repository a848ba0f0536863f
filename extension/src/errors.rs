//! Error reports in PostgreSQL's style: lowercase message, DETAIL and HINT as sentences.

use ccm_codec::{DecodeError, DecodeErrorKind, EncodeError};
use pgrx::pg_sys::panic::ErrorReport;
use pgrx::{PgLogLevel, PgSqlErrorCode};

/// Turns off the capture of Rust backtraces for this process and the backends it forks.
///
/// pgrx raises every ERROR as a Rust panic, and its panic hook captures a backtrace, which
/// std resolves whenever RUST_BACKTRACE or RUST_LIB_BACKTRACE is set in the server's
/// environment: symbolizing pg_ccm.so took 0.3 s per ERROR on a local disk and 4 s on a
/// throttled one, while a cancel or a recovery conflict waited. std reads the variables
/// once, at the first capture, and keeps the answer for the process: one capture made here
/// (in the postmaster, from _PG_init) with RUST_LIB_BACKTRACE=0 decides it for every backend
/// forked later. The environment is restored at once, so nothing else sees the change.
pub fn disable_backtraces() {
    const VARIABLE: &str = "RUST_LIB_BACKTRACE";
    let before = std::env::var_os(VARIABLE);
    std::env::set_var(VARIABLE, "0");
    let _ = std::backtrace::Backtrace::capture();
    match before {
        Some(value) => std::env::set_var(VARIABLE, value),
        None => std::env::remove_var(VARIABLE),
    }
}

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

/// Raises ERRCODE_OUT_OF_MEMORY, as palloc does, for an allocation of `bytes` that failed.
pub fn out_of_memory(what: &str, bytes: u64) -> ! {
    raise(
        PgSqlErrorCode::ERRCODE_OUT_OF_MEMORY,
        "out of memory".into(),
        Some(format!("Failed on a request of size {bytes} for {what}.")),
        None,
    )
}

/// Raises the ERROR for a block list that could not be encoded: out of memory (53200), as
/// palloc reports it, or an internal error (XX000) for a block no buffer header can hold.
pub fn encode_failed(error: &EncodeError) -> ! {
    match error {
        EncodeError::OutOfMemory { bytes } => out_of_memory("a pg_ccm block list", *bytes),
        other => raise(
            PgSqlErrorCode::ERRCODE_INTERNAL_ERROR,
            "could not encode a pg_ccm block list".into(),
            Some(sentence(&other.to_string())),
            None,
        ),
    }
}

/// Raises the ERROR for a block list the codec refused. `limit_hint` explains the limit of
/// the calling function when the list is over it.
///
/// - over the caller's block limit: 54000 program_limit_exceeded;
/// - allocation failure: 53200 out_of_memory, "out of memory", as palloc reports it;
/// - anything else: 22P03 invalid_binary_representation (`invalid_input`).
pub fn block_list_refused(error: &DecodeError, limit_hint: &str) -> ! {
    match error {
        DecodeError::TooManyBlocks { .. } => raise(
            PgSqlErrorCode::ERRCODE_PROGRAM_LIMIT_EXCEEDED,
            "pg_ccm block list has too many blocks".into(),
            Some(sentence(&error.to_string())),
            Some(limit_hint),
        ),
        DecodeError::OutOfMemory { bytes } => out_of_memory("a decoded pg_ccm block list", *bytes),
        _ => invalid_input("block list", error),
    }
}
