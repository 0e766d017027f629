//! Marks a build made with `MSSQL_CDC_TEST_URL` set, so the SQL Server conformance test runs
//! only then and is listed as ignored, with the reason, otherwise (a visible skip in every
//! test run instead of a test that passes without checking anything).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(mssql_test_url)");
    println!("cargo::rerun-if-env-changed=MSSQL_CDC_TEST_URL");
    if std::env::var_os("MSSQL_CDC_TEST_URL").is_some_and(|url| !url.is_empty()) {
        println!("cargo::rustc-cfg=mssql_test_url");
    }
}
