//! pg_ccm: cluster cache management for PostgreSQL streaming replication.
//!
//! The primary reports which cached blocks are hot, the tier-0 standby reports what it
//! caches, and ccm-agent moves the difference so that the standby's shared_buffers
//! mirror the primary's hot set. This file only wires the modules together.

use pgrx::prelude::*;

mod bgworker;
mod block_list;
mod buffers;
mod call_shape;
mod candidates;
mod catalog_oid;
mod changes;
mod compat;
mod errors;
mod failpoints;
mod filter;
mod gucs;
mod hot_blocks;
mod os_cache;
mod prewarm;
mod prewarm_worker;
mod readahead;
mod shmem;
mod status;
mod wal_cache;
mod wal_release;

#[cfg(any(test, feature = "pg_test"))]
mod tests;

::pgrx::pg_module_magic!(name, version);

#[pg_guard]
pub extern "C-unwind" fn _PG_init() {
    errors::disable_backtraces();
    if unsafe { !pg_sys::process_shared_preload_libraries_in_progress } {
        errors::raise(
            PgSqlErrorCode::ERRCODE_OBJECT_NOT_IN_PREREQUISITE_STATE,
            "pg_ccm must be loaded via shared_preload_libraries".into(),
            None,
            Some("Add pg_ccm to shared_preload_libraries in postgresql.conf on every node and restart the server."),
        );
    }
    failpoints::init();
    gucs::init();
    shmem::init();
    candidates::init();
    changes::init();
    wal_cache::init();
    wal_release::init();
}

// Where a node's WAL comes from, for the agent's "never warm from the wrong primary" check.
// pg_stat_wal_receiver shows its sender and timeline only to pg_read_all_stats; the agent's
// role needs exactly these four values, so they are exposed through SECURITY DEFINER with a
// fixed search_path, as contrib does for narrow privileged reads.
extension_sql!(
    r#"
CREATE FUNCTION ccm_wal_source(
    OUT in_recovery bool,
    OUT timeline int4,
    OUT sender_host text,
    OUT sender_port int4
) RETURNS record
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
    -- A primary: the timeline it writes. A standby: the timeline its WAL receiver streams
    -- and from where (NULLs while no WAL receiver runs).
    SELECT r, CASE WHEN r THEN w.received_tli
                   ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int4 END,
           w.sender_host, w.sender_port
    FROM (SELECT pg_is_in_recovery()) AS s(r)
    LEFT JOIN pg_stat_wal_receiver AS w ON r AND w.status = 'streaming'
$$;
COMMENT ON FUNCTION ccm_wal_source() IS 'timeline and WAL sender of this node (for ccm-agent)';
"#,
    name = "wal_source",
);

// Nothing is executable by PUBLIC. Status and inspection go to pg_monitor; the transfer
// functions to ccm_agent, the group role of the agent's (non-superuser) login role.
extension_sql!(
    r#"
-- The agent's group role. A role of that name that already exists (an earlier install, or
-- another database of this cluster) is adopted only if it is a plain group role, and its
-- members are named, since they get the transfer functions.
DO $$
DECLARE
    existing pg_catalog.pg_roles;
    members text;
    admins text;
BEGIN
    SELECT * INTO existing FROM pg_catalog.pg_roles WHERE rolname = 'ccm_agent';
    IF NOT FOUND THEN
        CREATE ROLE ccm_agent NOLOGIN;
        RETURN;
    END IF;
    IF existing.rolcanlogin OR existing.rolsuper OR existing.rolcreaterole OR existing.rolcreatedb
       OR existing.rolreplication OR existing.rolbypassrls THEN
        RAISE EXCEPTION 'role "ccm_agent" already exists and is not a plain group role'
            USING ERRCODE = 'duplicate_object',
                  DETAIL = 'pg_ccm grants its block transfer functions to the group role ccm_agent, which must be NOLOGIN and hold no other attribute.',
                  HINT = 'Drop or rename that role, or remove its attributes, then create the extension again.';
    END IF;
    SELECT pg_catalog.string_agg(pg_catalog.quote_ident(m.rolname), ', ' ORDER BY m.rolname) INTO members
    FROM pg_catalog.pg_auth_members a JOIN pg_catalog.pg_roles m ON m.oid = a.member
    WHERE a.roleid = existing.oid;
    -- Who can make more members: those holding ADMIN OPTION on it (from PostgreSQL 16 on,
    -- also a non-superuser role's creator, recorded the same way).
    SELECT pg_catalog.string_agg(DISTINCT pg_catalog.quote_ident(m.rolname), ', ') INTO admins
    FROM pg_catalog.pg_auth_members a JOIN pg_catalog.pg_roles m ON m.oid = a.member
    WHERE a.roleid = existing.oid AND a.admin_option;
    RAISE WARNING 'using the existing role "ccm_agent" for pg_ccm''s agent'
        USING DETAIL = pg_catalog.format('Its members (%s) can call ccm_buffer_filter(), ccm_hot_blocks() and ccm_prewarm(). Roles holding ADMIN OPTION on it (%s) can grant it to others.',
                                         COALESCE(members, 'none'), COALESCE(admins, 'none'));
END
$$;

REVOKE ALL ON FUNCTION aurora_ccm_status() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_filter_info(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_filter_contains(bytea, oid, oid, oid, int2, int8) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_block_list_info(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_unpack_block_list(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_hot_buffers(bytea, int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_buffer_filter(float8) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_hot_blocks(bytea, int8, int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_hot_blocks_each(bytea[], int8[], int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea, bool) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_wal_source() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_prewarm(bytea) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_os_prefetch(bytea, bool) FROM PUBLIC;
REVOKE ALL ON FUNCTION aurora_stat_logical_wal_cache() FROM PUBLIC;
REVOKE ALL ON FUNCTION aurora_stat_reset_wal_cache(text) FROM PUBLIC;
REVOKE ALL ON FUNCTION get_oldest_wal_cache_ptr() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_logical_wal_cache_status() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_library_version() FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_report_candidates(text, int8, text[], text[], float8[], int8[], int8[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_candidate_reports() FROM PUBLIC;
REVOKE ALL ON ccm_candidates FROM PUBLIC;

GRANT EXECUTE ON FUNCTION aurora_ccm_status() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_filter_info(bytea) TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_filter_contains(bytea, oid, oid, oid, int2, int8) TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_block_list_info(bytea) TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_unpack_block_list(bytea) TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_hot_buffers(bytea, int4) TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_buffer_filter(float8) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_hot_blocks(bytea, int8, int4) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_hot_blocks_each(bytea[], int8[], int4) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea, bool) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_wal_source() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_prewarm(bytea) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_os_prefetch(bytea, bool) TO ccm_agent;
GRANT EXECUTE ON FUNCTION aurora_stat_logical_wal_cache() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION get_oldest_wal_cache_ptr() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_logical_wal_cache_status() TO pg_monitor, ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_library_version() TO pg_monitor, ccm_agent;
-- The agent writes its report of the candidates; monitoring reads it (the view's function
-- runs with the reader's privileges, so it is granted with the view).
GRANT EXECUTE ON FUNCTION ccm_report_candidates(text, int8, text[], text[], float8[], int8[], int8[]) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_candidate_reports() TO pg_monitor, ccm_agent;
GRANT SELECT ON ccm_candidates TO pg_monitor, ccm_agent;
-- Resetting statistics is for superusers, as pg_stat_reset() is.
"#,
    name = "privileges",
    finalize,
);

/// Required by `cargo pgrx test`.
#[cfg(test)]
pub mod pg_test {
    pub fn setup(_options: Vec<&str>) {}

    #[must_use]
    pub fn postgresql_conf_options() -> Vec<&'static str> {
        vec!["shared_preload_libraries = 'pg_ccm'"]
    }
}
