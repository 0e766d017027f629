-- Enables CDC on a database and creates the sample tables the simulator models
-- (dbo.customers, dbo.orders), each with its default capture instance.
-- Run with sqlcmd -v DATABASE=cdc_lab -i sql/00_setup.sql as a member of sysadmin
-- (sys.sp_cdc_enable_db) and db_owner. SQL Server Agent must run for the capture job.
USE [$(DATABASE)];
GO
IF (SELECT is_cdc_enabled FROM sys.databases WHERE name = DB_NAME()) = 0
    EXEC sys.sp_cdc_enable_db;
GO
IF OBJECT_ID(N'dbo.customers') IS NULL
CREATE TABLE dbo.customers (
    customer_id  int               NOT NULL PRIMARY KEY,
    name         nvarchar(100)     NOT NULL,
    email        nvarchar(200)     NULL,
    balance      decimal(12, 2)    NOT NULL,
    segment      tinyint           NOT NULL,
    created_at   datetime2(7)      NOT NULL,
    last_login   datetime          NULL,
    is_active    bit               NOT NULL,
    external_id  uniqueidentifier  NOT NULL
);
GO
IF OBJECT_ID(N'dbo.orders') IS NULL
CREATE TABLE dbo.orders (
    order_id       bigint             NOT NULL PRIMARY KEY,
    customer_id    int                NOT NULL,
    amount         money              NOT NULL,
    quantity       smallint           NOT NULL,
    status         varchar(20)        NOT NULL,
    note           nvarchar(max)      NULL,
    ordered_at     datetime2(3)       NOT NULL,
    shipped_on     date               NULL,
    discount_rate  float              NULL,
    placed_at      datetimeoffset(7)  NOT NULL
);
GO
IF NOT EXISTS (SELECT 1 FROM cdc.change_tables WHERE capture_instance = N'dbo_customers')
    EXEC sys.sp_cdc_enable_table @source_schema = N'dbo', @source_name = N'customers',
        @role_name = NULL, @supports_net_changes = 0;
IF NOT EXISTS (SELECT 1 FROM cdc.change_tables WHERE capture_instance = N'dbo_orders')
    EXEC sys.sp_cdc_enable_table @source_schema = N'dbo', @source_name = N'orders',
        @role_name = NULL, @supports_net_changes = 0;
GO
