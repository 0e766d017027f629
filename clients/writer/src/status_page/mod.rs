//! The sidecar's HTTP face (`status_listen`): a live status page of every table, the same as
//! JSON, and the liveness and readiness probes an orchestrator asks.
//!
//! - `GET /`: the page (`html`), with plots drawn as SVG on the server (`plots`);
//! - `GET /status.json`: the board ([`crate::board`]) and the readiness, as JSON;
//! - `GET /healthz`: 200 while the process serves (liveness);
//! - `GET /readyz`: 200 when every table streams, else 503 naming those that do not.
//!
//! With `admin_token_file` the page and the JSON need the admin token (`Bearer`, or a
//! browser's Basic login with the token as password); the probes never do, and say nothing
//! but the tables' states. An address other than loopback needs the token.

mod html;
mod plots;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use crate::admin::AdminToken;
use crate::board::board;
use crate::error::{Result, WriterError};

/// Seconds between reloads of the page.
pub const REFRESH_SECONDS: u32 = 5;

/// The status page's listener, bound and checked, not yet serving.
pub struct StatusPage {
    listener: TcpListener,
    token: Option<AdminToken>,
}

impl StatusPage {
    /// Binds `address`; refuses an address other than loopback without a token.
    pub async fn bind(address: &str, token: Option<AdminToken>) -> Result<Self> {
        let listener = TcpListener::bind(address)
            .await
            .map_err(|source| WriterError::Io {
                context: format!("binding the status page to {address}"),
                source,
            })?;
        let page = StatusPage { listener, token };
        let local = page.local_addr()?;
        if !local.ip().is_loopback() && page.token.is_none() {
            return Err(WriterError::invalid(format!(
                "status_listen {address} is not a loopback address: set admin_token_file so \
                 that only operators holding the token see the tables and their errors (the \
                 /healthz and /readyz probes stay open)"
            )));
        }
        Ok(page)
    }

    /// The address bound.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|source| WriterError::Io {
                context: "the status page's address".into(),
                source,
            })
    }

    /// Serves until `stop` turns true.
    pub async fn serve(self, mut stop: tokio::sync::watch::Receiver<bool>) -> Result<()> {
        let app = Router::new()
            .route("/", get(page))
            .route("/status.json", get(status_json))
            .route("/healthz", get(healthz))
            .route("/readyz", get(readyz))
            .with_state(self.token);
        axum::serve(self.listener, app)
            .with_graceful_shutdown(async move {
                let _ = stop.wait_for(|stopped| *stopped).await;
            })
            .await
            .map_err(|source| WriterError::Io {
                context: "serving the status page".into(),
                source,
            })
    }
}

/// `None` when the caller may see the page, else the 401 that asks a browser to log in.
fn refused(token: &Option<AdminToken>, headers: &HeaderMap) -> Option<Response> {
    let token = token.as_ref()?;
    let offered = headers.get(header::AUTHORIZATION);
    if offered.is_some_and(|value| token.admits_http(value.as_bytes())) {
        return None;
    }
    tracing::warn!(
        token_sent = offered.is_some(),
        "status page request refused"
    );
    let mut response = (
        StatusCode::UNAUTHORIZED,
        "the admin token is required (Bearer, or log in with the token as password)\n",
    )
        .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"mssql-cdc-writer\""),
    );
    Some(response)
}

async fn page(State(token): State<Option<AdminToken>>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refused(&token, &headers) {
        return refusal;
    }
    let board = board();
    Html(html::page(
        &board.tables(),
        &board.readiness(),
        chrono::Utc::now(),
        REFRESH_SECONDS,
    ))
    .into_response()
}

async fn status_json(State(token): State<Option<AdminToken>>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refused(&token, &headers) {
        return refusal;
    }
    let board = board();
    Json(serde_json::json!({
        "readiness": board.readiness(),
        "tables": board.tables(),
    }))
    .into_response()
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz() -> Response {
    let readiness = board().readiness();
    let code = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(readiness)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_address_off_loopback_needs_the_token() {
        let refused = StatusPage::bind("0.0.0.0:0", None)
            .await
            .err()
            .expect("refused");
        assert!(
            refused.to_string().contains("admin_token_file"),
            "{refused}"
        );
        let token = AdminToken::new("0123456789abcdef").expect("token");
        assert!(StatusPage::bind("0.0.0.0:0", Some(token)).await.is_ok());
        assert!(StatusPage::bind("127.0.0.1:0", None).await.is_ok());
    }
}
