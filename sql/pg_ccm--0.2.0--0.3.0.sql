/* pg_ccm 0.2.0 -> 0.3.0: no change to the SQL objects.

   0.3.0 changes how ccm_prewarm() reads (under AccessShareLock on each relation, through a
   worker per other database, never discarding buffers, only on a standby): that is the
   shared library's code, loaded by every version. The install script's ccm_agent role
   check applies to new installs; an upgraded database keeps the role it has.
   Released scripts are never edited. */

\echo Use "ALTER EXTENSION pg_ccm UPDATE TO '0.3.0'" to load this file. \quit
