/* pg_ccm 0.6.0 -> 0.7.0: a catalog that a library older than itself cannot misread.

   ccm_buffer_changes() keeps its arguments and result columns, but is bound to a versioned
   symbol, ccm_buffer_changes_0_7_wrapper, as pg_stat_statements versions its symbols: a
   node still running an older library (a standby not yet restarted in a rolling upgrade)
   then fails the call with "could not find function" instead of reading past its result.
   CREATE OR REPLACE keeps the function's privileges. ccm_library_version() reports the
   loaded library, as the setting ccm.library_version does.

   Order of a rolling upgrade (README, "Upgrading"): install the 0.7.0 library on every node
   and restart each (standbys first, then switch over or restart the primary), and only
   then run ALTER EXTENSION pg_ccm UPDATE on the primary. A 0.7.0 library serves the 0.6.0
   catalog meanwhile. Released scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.7.0'" to load this file. \quit

CREATE OR REPLACE FUNCTION "ccm_buffer_changes"(
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
AS 'MODULE_PATHNAME', 'ccm_buffer_changes_0_7_wrapper';

CREATE FUNCTION "ccm_library_version"() RETURNS TEXT
STABLE PARALLEL SAFE
LANGUAGE c
AS 'MODULE_PATHNAME', 'ccm_library_version_wrapper';

REVOKE ALL ON FUNCTION ccm_library_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION ccm_library_version() TO pg_monitor, ccm_agent;
