//! Generates the contract's Rust types from the `.proto` files beside this script: protox
//! compiles them to a descriptor set in pure Rust (no `protoc` on the build machine), and
//! tonic-prost-build turns that into prost messages and, for the admin service, its tonic
//! server and client.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["mssql_cdc_flight.proto", "mssql_cdc_admin.proto"];
    let descriptors = protox::compile(files, ["."])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    Ok(())
}
