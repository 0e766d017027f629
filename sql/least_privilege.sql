-- The login and grants mssql-cdc-flight needs, and nothing more (ADR 0009 of the seeds).
-- Run in the CDC database as db_owner, after 00_setup.sql:
--   sqlcmd -v DATABASE=cdc_lab READER_PASSWORD='...' -i sql/least_privilege.sql
--
-- What each grant is for:
--   SELECT ON SCHEMA::cdc       change tables cdc.[<ci>_CT], cdc.lsn_time_mapping,
--                               cdc.ddl_history, cdc.change_tables (reads only)
--   SELECT ON each source table snapshot reads, key extent and slice counts; it also makes
--                               sys.sp_cdc_help_change_data_capture and
--                               sys.sp_cdc_get_captured_columns list the table's instances
--                               (they show only instances whose captured columns the caller
--                               may select) and sys.columns show its columns
-- Everything else the server calls (sys.fn_cdc_get_max_lsn, sys.fn_cdc_get_min_lsn,
-- sys.fn_cdc_increment_lsn, sys.fn_cdc_decrement_lsn, sys.sp_spaceused, SERVERPROPERTY,
-- CURRENT_TIMEZONE_ID) is open to every user. No INSERT, UPDATE, DELETE, EXECUTE or
-- VIEW SERVER STATE is needed: the server never writes to the source.
-- A capture instance enabled with a gating @role_name also needs: ALTER ROLE [<role>] ADD
-- MEMBER [cdc_reader];
USE [master];
GO
IF SUSER_ID(N'cdc_reader') IS NULL
    CREATE LOGIN [cdc_reader] WITH PASSWORD = N'$(READER_PASSWORD)', CHECK_POLICY = ON;
GO
USE [$(DATABASE)];
GO
IF USER_ID(N'cdc_reader') IS NULL
    CREATE USER [cdc_reader] FOR LOGIN [cdc_reader];
GO
GRANT SELECT ON SCHEMA::cdc TO [cdc_reader];
GRANT SELECT ON OBJECT::dbo.customers TO [cdc_reader];
GRANT SELECT ON OBJECT::dbo.orders TO [cdc_reader];
GO
-- A capture instance added later (sql/switch_capture_instance.sql) is covered by the schema
-- grant; a new tracked table needs its own: GRANT SELECT ON OBJECT::<schema>.<table> TO [cdc_reader];
