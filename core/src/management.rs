//! RabbitMQ's management HTTP API (the plugin `rabbitmq_management`), as the service's broker
//! user: the one client of it, for the admin tool (tenants' users, permissions, limits and
//! operator policies) and the scheduler (the live-output watch, which holds each tenant to its
//! share of queues and bindings).
//!
//! The user and password are those of `SANDCELL_AMQP_URL`, and paths name the vhost as
//! `{vhost}`, replaced by that URL's vhost, percent-encoded.

use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde::de::DeserializeOwned;

/// A client of the management API.
#[derive(Clone)]
pub struct Management {
    http: reqwest::Client,
    /// `http://host:15672`, without a trailing slash.
    base: String,
    user: String,
    password: String,
    /// The vhost of `SANDCELL_AMQP_URL`, encoded for a path.
    vhost: String,
}

impl Management {
    /// A client of the API at `management_url` (`SANDCELL_RABBITMQ_MANAGEMENT_URL`), as the user
    /// of `amqp_url` in its vhost. Each request may take `timeout`.
    pub fn new(management_url: &str, amqp_url: &str, timeout: Duration) -> Result<Self> {
        let uri: lapin::uri::AMQPUri = amqp_url.parse().map_err(|e| anyhow!("parsing SANDCELL_AMQP_URL: {e}"))?;
        let http = reqwest::Client::builder().timeout(timeout).build().context("building the management API's HTTP client")?;
        Ok(Management {
            http,
            base: management_url.trim_end_matches('/').to_string(),
            user: uri.authority.userinfo.username,
            password: uri.authority.userinfo.password,
            vhost: encode_component(&uri.vhost),
        })
    }

    /// `/api/<path>`'s JSON; `None` when the API answers 404.
    pub async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<Option<T>> {
        let resp = self.send(reqwest::Method::GET, path, None, None).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let resp = ok_or_error(reqwest::Method::GET, path, resp).await?;
        resp.json().await.with_context(|| format!("reading the management API's answer to GET /api/{path}")).map(Some)
    }

    /// PUT `body` at `/api/<path>`.
    pub async fn put(&self, path: &str, body: serde_json::Value) -> Result<()> {
        let resp = self.send(reqwest::Method::PUT, path, Some(body), None).await?;
        ok_or_error(reqwest::Method::PUT, path, resp).await.map(drop)
    }

    /// DELETE `/api/<path>`, with `reason` (the `X-Reason` header: a closed connection's
    /// client reads it). What is not there is not an error: returns whether it was.
    pub async fn delete(&self, path: &str, reason: Option<&str>) -> Result<bool> {
        let resp = self.send(reqwest::Method::DELETE, path, None, reason).await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(false);
        }
        ok_or_error(reqwest::Method::DELETE, path, resp).await.map(|_| true)
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<serde_json::Value>, reason: Option<&str>) -> Result<reqwest::Response> {
        let url = format!("{}/api/{}", self.base, path.replace("{vhost}", &self.vhost));
        let mut req = self.http.request(method.clone(), &url).basic_auth(&self.user, Some(&self.password));
        if let Some(body) = body {
            req = req.json(&body);
        }
        if let Some(reason) = reason {
            req = req.header("X-Reason", reason);
        }
        req.send().await.with_context(|| format!("calling the RabbitMQ management API: {method} {}/api/{path} (is rabbitmq_management enabled?)", self.base))
    }
}

async fn ok_or_error(method: reqwest::Method, path: &str, resp: reqwest::Response) -> Result<reqwest::Response> {
    if resp.status().is_success() {
        return Ok(resp);
    }
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    bail!("RabbitMQ management API: {method} /api/{path} answered {status}: {text}")
}

/// Percent-encode a path component (the vhost `/` is `%2F`; a queue's name keeps its dots).
pub fn encode_component(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_vhost_is_encoded() {
        assert_eq!(encode_component("/"), "%2F");
        assert_eq!(encode_component("prod"), "prod");
        assert_eq!(encode_component("sandcell.live.acme.q 1"), "sandcell.live.acme.q%201");
    }

    #[test]
    fn the_vhost_and_user_come_from_the_amqp_url() {
        let m = Management::new("http://127.0.0.1:15672/", "amqp://sandcell:pw@127.0.0.1:5672/%2f", Duration::from_secs(1)).unwrap();
        assert_eq!((m.base.as_str(), m.user.as_str(), m.password.as_str(), m.vhost.as_str()), ("http://127.0.0.1:15672", "sandcell", "pw", "%2F"));
    }
}
