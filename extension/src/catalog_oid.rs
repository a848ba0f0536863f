//! An `oid` result column that may legitimately be 0.
//!
//! pgrx returns `pg_sys::Oid` 0 (InvalidOid) as SQL NULL, but a buffer of a shared
//! catalog has database 0, and pg_buffercache shows it as 0. This newtype returns the
//! number as it is, so our rows join with pg_buffercache's.

use pgrx::pg_sys;
use pgrx::IntoDatum;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CatalogOid(pub u32);

impl IntoDatum for CatalogOid {
    fn into_datum(self) -> Option<pg_sys::Datum> {
        Some(pg_sys::Datum::from(self.0))
    }

    fn type_oid() -> pg_sys::Oid {
        pg_sys::OIDOID
    }
}

pgrx::impl_sql_translatable!(CatalogOid, "oid");

// SAFETY: an oid is a by-value Datum; nothing is allocated.
unsafe impl pgrx::callconv::BoxRet for CatalogOid {
    unsafe fn box_into<'fcx>(self, fcinfo: &mut pgrx::callconv::FcInfo<'fcx>) -> pgrx::datum::Datum<'fcx> {
        unsafe { fcinfo.return_raw_datum(pg_sys::Datum::from(self.0)) }
    }
}
