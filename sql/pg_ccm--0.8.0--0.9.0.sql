/* pg_ccm 0.8.0 -> 0.9.0: the operating system's page cache, the second tier (issue 26).

   A vanilla PostgreSQL host keeps most of its working set in the kernel's page cache, not in
   shared_buffers. ccm_os_cached_blocks() lists, from a cursor and a bounded number of files
   or blocks at a time, the blocks of permanent relations' main forks that a node's page
   cache holds (mincore); ccm_os_prefetch() reads the listed blocks into a standby's page
   cache (posix_fadvise WILLNEED, as pg_prewarm's 'prefetch' mode), never into its
   shared_buffers, takes no lock, and stops while less than ccm.os_cache_min_free (a new
   GUC, 1 GB by default) is free. Both are granted to ccm_agent only.

   Nothing that 0.8.0 has changes shape, so a 0.8.0 library serves this catalog's other
   functions; the two new ones fail there with "could not find function" until the node runs
   the 0.9.0 library. Order of a rolling upgrade as before (README, "Upgrading"): the library
   on every node first, then ALTER EXTENSION pg_ccm UPDATE on the primary. Released scripts
   are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.9.0'" to load this file. \quit

CREATE FUNCTION "ccm_os_cached_blocks"(
	"after_spc" oid,
	"after_db" oid,
	"after_rel" oid,
	"after_block" bigint,
	"max_blocks" bigint,
	"max_files" INT
) RETURNS TABLE (
	"list" bytea,
	"last_spc" oid,
	"last_db" oid,
	"last_rel" oid,
	"last_block" bigint,
	"complete" bool,
	"files" INT,
	"in_play" bool
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_os_cached_blocks_wrapper';

CREATE FUNCTION "ccm_os_prefetch"(
	"list" bytea,
	"advise" bool DEFAULT true
) RETURNS TABLE (
	"requested" bigint,
	"already_cached" bigint,
	"advised" bigint,
	"skipped" bigint,
	"limited" bool,
	"in_play" bool
)
STRICT VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_os_prefetch_wrapper';

COMMENT ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) IS 'blocks of permanent relations'' main forks that this node''s page cache holds, from a cursor on (for ccm-agent)';
COMMENT ON FUNCTION ccm_os_prefetch(bytea, bool) IS 'reads the listed blocks into this standby''s page cache, not its shared_buffers, while memory is free (for ccm-agent)';

REVOKE ALL ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) FROM PUBLIC;
REVOKE ALL ON FUNCTION ccm_os_prefetch(bytea, bool) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_os_cached_blocks(oid, oid, oid, int8, int8, int4) TO ccm_agent;
GRANT EXECUTE ON FUNCTION ccm_os_prefetch(bytea, bool) TO ccm_agent;
