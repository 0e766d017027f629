# syntax=docker/dockerfile:1.7
# The image of mssql-cdc-flight: the Flight server (the default command) and the writer
# sidecar (`mssql-cdc-writer`), release builds, on a small Debian runtime as a non-root user.
#
#   docker build -t mssql-cdc-flight .
#   docker run -p 50051:50051 -v ./secrets:/run/secrets:ro mssql-cdc-flight
#
# The server reads its source from /run/secrets/cdc-source (a SQL Server URL or connection
# string), its principals from /run/secrets/tokens.json and its TLS certificate and key from
# /run/secrets/tls.crt and tls.key (docs/security.md): it listens on 0.0.0.0, where
# authentication and TLS are required. The certificate names `localhost` for the health check
# (which trusts /run/secrets/ca.crt), and the names clients use. deploy/compose.yml runs SQL
# Server, the server and the writer together.

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The writer's object stores (S3 and Azure Blob, tested on emulators by scripts/test); add
# mssql-cdc-writer/gcs for Google Cloud Storage.
ARG WRITER_FEATURES=mssql-cdc-writer/s3,mssql-cdc-writer/azure
# Dependencies first: the manifests, the lock file and the contract's .proto files, built
# against placeholder sources, so a change of our code does not rebuild the dependencies. The
# registry and target directories are BuildKit caches as well.
COPY Cargo.toml Cargo.lock ./
COPY proto/Cargo.toml proto/build.rs proto/
COPY proto/mssql_cdc_flight.proto proto/mssql_cdc_admin.proto proto/
COPY clients/writer/Cargo.toml clients/writer/
RUN mkdir -p src proto/src clients/writer/src benches clients/writer/benches tests clients/writer/tests/model \
    && touch src/lib.rs proto/src/lib.rs clients/writer/src/lib.rs \
    && for stub in src/main.rs clients/writer/src/main.rs benches/throughput.rs \
        benches/catalog.rs benches/masking.rs tests/sqlserver_statements.rs \
        tests/fuzz_parsers.rs \
        clients/writer/benches/end_to_end.rs clients/writer/benches/snapshot.rs \
        clients/writer/benches/silver.rs clients/writer/benches/freshness.rs \
        clients/writer/benches/reconcile.rs clients/writer/benches/many_tables.rs \
        clients/writer/benches/facts_appends.rs clients/writer/benches/busy_bronze.rs \
        clients/writer/benches/history.rs \
        clients/writer/tests/model/main.rs; \
        do echo 'fn main() {}' > "$stub"; done
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --workspace --bins --features "$WRITER_FEATURES"
# Then the project itself.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    touch src/main.rs src/lib.rs proto/src/lib.rs clients/writer/src/main.rs clients/writer/src/lib.rs \
    && cargo build --release --locked --bin mssql-cdc-flight --bin mssql-cdc-writer \
        --features "$WRITER_FEATURES" \
    && mkdir -p /out && cp target/release/mssql-cdc-flight target/release/mssql-cdc-writer /out/

FROM debian:bookworm-slim AS runtime
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin cdc
COPY --from=build /out/mssql-cdc-flight /out/mssql-cdc-writer /usr/local/bin/
USER 10001:10001
# Paths of the secrets, not secrets: the files are mounted at run time. The CA serves the
# HEALTHCHECK (`health` asks MSSQL_CDC_FLIGHT_URL) and the writer, which verifies an
# https:// server against it; the URL is also the default `--server` of the binaries' one-off
# commands. Behind a mesh that encrypts for it: -e MSSQL_CDC_FLIGHT_TLS_CERT= -e
# MSSQL_CDC_FLIGHT_TLS_KEY= -e MSSQL_CDC_FLIGHT_URL=http://127.0.0.1:50051, and serve
# --insecure-no-tls.
# hadolint ignore=DL3064
ENV MSSQL_CDC_FLIGHT_LISTEN=0.0.0.0:50051 \
    MSSQL_CDC_FLIGHT_SOURCE_FILE=/run/secrets/cdc-source \
    MSSQL_CDC_FLIGHT_TOKENS_FILE=/run/secrets/tokens.json \
    MSSQL_CDC_FLIGHT_TLS_CERT=/run/secrets/tls.crt \
    MSSQL_CDC_FLIGHT_TLS_KEY=/run/secrets/tls.key \
    MSSQL_CDC_FLIGHT_TLS_CA=/run/secrets/ca.crt \
    MSSQL_CDC_FLIGHT_URL=https://localhost:50051 \
    RUST_LOG=info
# 50051: the server; 8088: a writer sidecar's status page and probes (status_listen).
EXPOSE 50051 8088
HEALTHCHECK --interval=15s --timeout=6s --start-period=20s --retries=3 \
    CMD ["mssql-cdc-flight", "health"]
LABEL org.opencontainers.image.title="mssql-cdc-flight" \
      org.opencontainers.image.description="SQL Server change data capture as Arrow Flight streams, and the writer that lands them in Delta Lake" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/mssql-cdc-flight/mssql-cdc-flight"
ENTRYPOINT ["mssql-cdc-flight"]
CMD ["serve"]
