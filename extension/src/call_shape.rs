//! The shape a catalog gives a C function, checked against the shape this library returns.
//!
//! Catalogs replicate and libraries do not: during a rolling upgrade a node can run a library
//! whose functions differ from what its catalog declares. A changed signature gets a new
//! symbol (pg_stat_statements' `_1_2` to `_1_11`); a symbol that older catalogs still bind
//! checks the caller's argument count and result descriptor first, as pg_buffercache_pages
//! checks `natts`, and raises a clear ERROR where pgrx would form a tuple of the wrong shape.

use pgrx::prelude::*;
use pgrx::PgSqlErrorCode;

use crate::errors;

/// Arguments and result columns of one function.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct Shape {
    pub arguments: i32,
    pub columns: i32,
}

/// What the catalog's declaration of the function being called looks like.
fn declared(fcinfo: pg_sys::FunctionCallInfo) -> Shape {
    let mut descriptor: pg_sys::TupleDesc = std::ptr::null_mut();
    // SAFETY: fcinfo is the fmgr call in progress; get_call_result_type only reads it.
    let class = unsafe { pg_sys::get_call_result_type(fcinfo, std::ptr::null_mut(), &mut descriptor) };
    let columns = if class == pg_sys::TypeFuncClass::TYPEFUNC_COMPOSITE && !descriptor.is_null() {
        unsafe { (*descriptor).natts }
    } else {
        1
    };
    Shape { arguments: i32::from(unsafe { (*fcinfo).nargs }), columns }
}

/// Raises 55000 unless the catalog declares `function` with the shape this library has.
pub fn require(fcinfo: pg_sys::FunctionCallInfo, function: &str, library: Shape) {
    let catalog = declared(fcinfo);
    if catalog == library {
        return;
    }
    errors::raise(
        PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
        format!("function {function} of the pg_ccm catalog does not match the loaded pg_ccm library"),
        Some(format!(
            "The catalog declares {} arguments and {} result columns; library {} has {} and {}.",
            catalog.arguments,
            catalog.columns,
            env!("CARGO_PKG_VERSION"),
            library.arguments,
            library.columns
        )),
        Some("Install the same pg_ccm version on every node and restart them, then run ALTER EXTENSION pg_ccm UPDATE on the primary."),
    )
}
