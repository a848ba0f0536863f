/* pg_ccm 0.5.0 -> 0.6.0: the colder set in the change feed.

   ccm_buffer_changes() takes a sixth argument, colder (default false): with it, the feed
   also reports the cached blocks below the hot set in two more result columns,
   colder_added and colder_removed, so that ccm-agent fills a standby's unused buffers from
   the feed instead of a filter of the standby and a scan of the primary. A function's
   result columns cannot be changed in place: it is dropped and created again, with the
   same privileges (ccm_agent only). The shared memory is the same as 0.5.0's: no restart
   is needed beyond loading the 0.6.0 library. Released scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.6.0'" to load this file. \quit

DROP FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea);

CREATE FUNCTION "ccm_buffer_changes"(
	"subscriber" bigint,
	"after" bigint,
	"usage_threshold" INT DEFAULT NULL,
	"max_buffers" bigint DEFAULT NULL,
	"probe" bytea DEFAULT NULL,
	"colder" bool DEFAULT false
) RETURNS TABLE (
	"seq" bigint,
	"reset" bool,
	"reset_reason" TEXT,
	"buffers" bigint,
	"tracked" bigint,
	"sweeps" bigint,
	"visited" bigint,
	"added" bytea,
	"removed" bytea,
	"present" bytea,
	"colder_added" bytea,
	"colder_removed" bytea
)
VOLATILE PARALLEL UNSAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_buffer_changes_wrapper';

REVOKE ALL ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea, bool) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_buffer_changes(int8, int8, int4, int8, bytea, bool) TO ccm_agent;
