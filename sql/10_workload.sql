-- A small mixed workload on the sample tables for the integration suite: inserts, updates
-- (including an update of every row of a statement), deletes, in many transactions, then a
-- wait for the capture job. Idempotent: it continues from the highest key present.
--   sqlcmd -v DATABASE=cdc_lab -i sql/10_workload.sql
USE [$(DATABASE)];
GO
SET NOCOUNT ON;
DECLARE @base int = ISNULL((SELECT MAX(customer_id) FROM dbo.customers), 0);
DECLARE @i int = 1;
WHILE @i <= 200
BEGIN
    BEGIN TRANSACTION;
    INSERT INTO dbo.customers (customer_id, name, email, balance, segment, created_at, last_login, is_active, external_id)
    VALUES (@base + @i, CONCAT(N'customer ', @base + @i), CONCAT(N'c', @base + @i, N'@example.com'),
            (@base + @i) * 1.25, (@base + @i) % 256, SYSUTCDATETIME(), NULL, 1, NEWID());
    INSERT INTO dbo.orders (order_id, customer_id, amount, quantity, status, note, ordered_at, shipped_on, discount_rate, placed_at)
    VALUES (CAST(@base + @i AS bigint) * 10, @base + @i, (@base + @i) * 3.5, 1, 'new', NULL,
            SYSUTCDATETIME(), NULL, NULL, SYSDATETIMEOFFSET());
    COMMIT;
    IF @i % 5 = 0
        UPDATE dbo.customers SET balance = balance + 1, last_login = GETDATE() WHERE customer_id = @base + @i - 1;
    IF @i % 7 = 0
        UPDATE dbo.orders SET status = 'shipped', shipped_on = CAST(GETDATE() AS date) WHERE customer_id BETWEEN @base + @i - 6 AND @base + @i;
    IF @i % 11 = 0
        DELETE FROM dbo.orders WHERE order_id = CAST(@base + @i - 3 AS bigint) * 10;
    SET @i += 1;
END
GO
-- Let the capture job (every 5 s by default) pick everything up.
WAITFOR DELAY '00:00:15';
SELECT CONVERT(varchar(22), sys.fn_cdc_get_max_lsn(), 1) AS max_lsn;
GO
