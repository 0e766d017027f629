//! The sidecar's HTTP face (`status_listen`): a live status page of every table, the same as
//! JSON, and the liveness and readiness probes an orchestrator asks.
//!
//! - `GET /`: the page (`html`), with plots drawn as SVG on the server (`plots`);
//! - `GET /status.json`: the board ([`crate::board`]) and the readiness, as JSON;
//! - `GET /healthz`: 200 while the process serves (liveness);
//! - `GET /readyz`: 200 when every table streams, else 503 naming those that do not.
//!
//! With `status_token_file` the page and the JSON need its token (`Bearer`, or a browser's
//! Basic login with the token as password), a viewer's token that cannot pause, resume or
//! re-snapshot; without it, the admin token (`admin_token_file`) is asked for, with a warning
//! at start. The probes never need one, and say nothing but the tables' states. An address
//! other than loopback needs a token. Refusals are logged at most once a minute.

mod html;
mod plots;

use std::net::SocketAddr;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Json, Response};
use axum::routing::get;
use tokio::net::TcpListener;

use std::sync::Arc;

use mssql_cdc_proto::throttle::PeerThrottle;

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
                "status_listen {address} is not a loopback address: set status_token_file so \
                 that only viewers holding the token see the tables and their errors (the \
                 /healthz and /readyz probes stay open)"
            )));
        }
        Ok(page)
    }

    /// The token the page asks for: `status` (a viewer's), else `admin` with a warning,
    /// since the page's password would then also pause, resume and re-snapshot. The same
    /// token in both files is refused: the point of two is that they differ.
    pub fn token_of(
        status: Option<AdminToken>,
        admin: Option<AdminToken>,
    ) -> Result<Option<AdminToken>> {
        match (status, admin) {
            (Some(status), Some(admin)) if status.same_as(&admin) => Err(WriterError::invalid(
                "status_token_file holds the admin token: give the status page a token of its \
                 own, which cannot pause, resume or re-snapshot",
            )),
            (Some(status), _) => Ok(Some(status)),
            (None, Some(admin)) => {
                tracing::warn!(
                    "the status page asks for the admin token, which also pauses, resumes and \
                     re-snapshots tables: set status_token_file to give viewers a token of \
                     their own"
                );
                Ok(Some(admin))
            }
            (None, None) => Ok(None),
        }
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
            .with_state(PageState {
                token: self.token,
                refusals: Arc::new(PeerThrottle::default()),
            });
        mssql_cdc_proto::pages::serve_page(self.listener, app, async move {
            let _ = stop.wait_for(|stopped| *stopped).await;
        })
        .await;
        Ok(())
    }
}

/// What the page's handlers share: the token asked for, and the refusals' log throttle.
#[derive(Clone)]
struct PageState {
    token: Option<AdminToken>,
    refusals: Arc<PeerThrottle>,
}

/// `None` when the caller may see the page, else the 401 that asks a browser to log in.
fn refused(state: &PageState, headers: &HeaderMap) -> Option<Response> {
    let token = state.token.as_ref()?;
    let offered = headers.get(header::AUTHORIZATION);
    if offered.is_some_and(|value| token.admits_http(value.as_bytes())) {
        return None;
    }
    if let Some(suppressed) = state.refusals.due(None, std::time::Instant::now()) {
        tracing::warn!(
            token_sent = offered.is_some(),
            suppressed,
            "status page request refused (logged at most once a minute)"
        );
    }
    let mut response = (
        StatusCode::UNAUTHORIZED,
        "the status page's token is required (Bearer, or log in with the token as password)\n",
    )
        .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Basic realm=\"mssql-cdc-writer\""),
    );
    Some(response)
}

async fn page(State(state): State<PageState>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refused(&state, &headers) {
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

async fn status_json(State(state): State<PageState>, headers: HeaderMap) -> Response {
    if let Some(refusal) = refused(&state, &headers) {
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
            refused.to_string().contains("status_token_file"),
            "{refused}"
        );
        let token = AdminToken::new("0123456789abcdef").expect("token");
        assert!(StatusPage::bind("0.0.0.0:0", Some(token)).await.is_ok());
        assert!(StatusPage::bind("127.0.0.1:0", None).await.is_ok());
    }

    #[test]
    fn the_page_asks_for_its_own_token_and_refuses_the_admin_one_as_it() {
        let token = |text: &str| Some(AdminToken::new(text).expect("token"));
        let viewer = StatusPage::token_of(token("viewer-0123456789"), token("admin-0123456789"))
            .expect("two tokens")
            .expect("the viewer's");
        assert!(viewer.admits_http(b"Bearer viewer-0123456789"));
        assert!(!viewer.admits_http(b"Bearer admin-0123456789"));
        let same = StatusPage::token_of(token("same-0123456789ab"), token("same-0123456789ab"))
            .expect_err("the admin token as the page's");
        assert!(same.to_string().contains("holds the admin token"), "{same}");
        let fallback = StatusPage::token_of(None, token("admin-0123456789"))
            .expect("the admin token, warned about")
            .expect("a token");
        assert!(fallback.admits_http(b"Bearer admin-0123456789"));
        assert!(StatusPage::token_of(None, None).expect("none").is_none());
    }
}
