-- The DBA procedure to move a table to a new capture instance (after a column is added or
-- its type changed) without losing a change: SQL Server allows two instances per table, and
-- a running stream follows the newer one by itself at its start LSN.
-- Edit the names, then run step by step as db_owner:
--   sqlcmd -v DATABASE=cdc_lab -i sql/switch_capture_instance.sql
USE [$(DATABASE)];
GO
-- 1. Enable the new instance with the columns it should capture.
EXEC sys.sp_cdc_enable_table
    @source_schema = N'dbo',
    @source_name = N'orders',
    @capture_instance = N'dbo_orders_v2',
    @role_name = NULL,
    @supports_net_changes = 0,
    @captured_column_list = N'order_id, customer_id, amount, quantity, status, note, ordered_at, shipped_on, discount_rate, placed_at';
GO
-- 2. The reader's schema grant (sql/least_privilege.sql) already covers cdc.[dbo_orders_v2_CT];
--    with table-level grants instead: GRANT SELECT ON cdc.[dbo_orders_v2_CT] TO [cdc_reader];
-- 3. Check it: both instances listed, and the new one's min_lsn is not 0x00 (the capture job
--    has processed its creation; wait for the Agent if it is).
EXEC sys.sp_cdc_help_change_data_capture @source_schema = N'dbo', @source_name = N'orders';
SELECT sys.fn_cdc_get_min_lsn(N'dbo_orders_v2') AS new_min_lsn;
GO
-- 4. Wait until every stream of the table has written its capture_instance_switched facts
--    row and one more batch (mssql-cdc-writer status shows it), then
-- 5. disable the old instance:
-- EXEC sys.sp_cdc_disable_table @source_schema = N'dbo', @source_name = N'orders',
--     @capture_instance = N'dbo_orders';
