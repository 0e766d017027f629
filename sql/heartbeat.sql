-- A CDC-tracked heartbeat for quiet databases: a one-row table updated every 10 seconds by
-- an Agent job, so max_lsn and commit times advance even when the tracked tables are idle
-- and the completeness verdict keeps moving (the seeds' sql/heartbeat.sql).
-- Run in the CDC database as db_owner with SQL Server Agent running:
--   sqlcmd -v DATABASE=cdc_lab -i sql/heartbeat.sql
USE [$(DATABASE)];
GO
IF OBJECT_ID(N'dbo.cdc_heartbeat') IS NULL
BEGIN
    CREATE TABLE dbo.cdc_heartbeat (id tinyint NOT NULL PRIMARY KEY, beat_at datetime2(3) NOT NULL);
    INSERT INTO dbo.cdc_heartbeat (id, beat_at) VALUES (1, SYSUTCDATETIME());
END
GO
IF NOT EXISTS (SELECT 1 FROM cdc.change_tables WHERE capture_instance = N'dbo_cdc_heartbeat')
    EXEC sys.sp_cdc_enable_table @source_schema = N'dbo', @source_name = N'cdc_heartbeat',
        @role_name = NULL, @supports_net_changes = 0;
GO
DECLARE @job sysname = N'cdc_heartbeat_' + DB_NAME();
DECLARE @command nvarchar(max) =
    N'UPDATE dbo.cdc_heartbeat SET beat_at = SYSUTCDATETIME() WHERE id = 1;';
DECLARE @database sysname = DB_NAME();
IF NOT EXISTS (SELECT 1 FROM msdb.dbo.sysjobs WHERE name = @job)
BEGIN
    EXEC msdb.dbo.sp_add_job @job_name = @job,
        @description = N'Keeps CDC max_lsn moving for mssql-cdc-flight on quiet databases';
    EXEC msdb.dbo.sp_add_jobstep @job_name = @job, @step_name = N'beat',
        @subsystem = N'TSQL', @database_name = @database, @command = @command;
    -- Every 10 seconds, all day (freq_subday_type 2 = seconds).
    EXEC msdb.dbo.sp_add_jobschedule @job_name = @job, @name = N'every 10 seconds',
        @freq_type = 4, @freq_interval = 1, @freq_subday_type = 2, @freq_subday_interval = 10;
    EXEC msdb.dbo.sp_add_jobserver @job_name = @job;
END
GO
-- The reader must see the heartbeat's capture instance too:
-- GRANT SELECT ON OBJECT::dbo.cdc_heartbeat TO [cdc_reader];
