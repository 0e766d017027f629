//! Generates the admin service's gRPC server and client (proto/mssql_cdc_admin.proto) with
//! tonic-build's manual builder: the messages are written in Rust (src/admin.rs), so no
//! `protoc` is needed to build.

fn main() {
    let method = |name: &str, route: &str, input: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(format!("crate::admin::{input}"))
            .output_type("crate::admin::SnapshotStateMessage")
            .codec_path("tonic_prost::ProstCodec")
            .build()
    };
    let service = tonic_build::manual::Service::builder()
        .name("SnapshotAdmin")
        .package("mssql_cdc.admin")
        .method(method("open", "Open", "OpenRequest"))
        .method(method("status", "Status", "TableRequest"))
        .method(method("pause", "Pause", "PauseRequest"))
        .method(method("resume", "Resume", "TableRequest"))
        .build();
    tonic_build::manual::Builder::new().compile(&[service]);
    println!("cargo:rerun-if-changed=build.rs");
}
