//! A small client of cove's own API, for the CLI and the benchmarks.

use anyhow::{bail, Context};
use serde_json::Value;

#[derive(clap::Args, Clone, Debug)]
pub(crate) struct Connection {
    /// The API URL of the server.
    #[arg(
        long,
        env = "DAYTONA_API_URL",
        default_value = "http://127.0.0.1:3000/api"
    )]
    pub url: String,
    /// The API key.
    #[arg(long, env = "COVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

#[derive(Clone)]
pub(crate) struct Client {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl Client {
    pub(crate) fn new(url: &str, key: &str) -> Client {
        Client {
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .expect("a plain HTTP client builds"),
            url: url.trim_end_matches('/').to_owned(),
            key: key.to_owned(),
        }
    }

    pub(crate) fn from_connection(connection: &Connection) -> anyhow::Result<Client> {
        let key = connection
            .api_key
            .clone()
            .or_else(|| std::env::var("DAYTONA_API_KEY").ok())
            .context("no API key: pass --api-key or set COVE_API_KEY")?;
        Ok(Client::new(&connection.url, &key))
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        let response = request.bearer_auth(&self.key).send().await?;
        let status = response.status();
        let text = response.text().await?;
        if !status.is_success() {
            let message = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.get("message").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or(text);
            bail!("{status}: {message}");
        }
        if text.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_str(&text).with_context(|| format!("invalid JSON answer: {text}"))
    }

    pub(crate) async fn api(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> anyhow::Result<Value> {
        let mut request = self.http.request(method, format!("{}{path}", self.url));
        if let Some(body) = body {
            request = request.json(&body);
        }
        self.send(request).await
    }

    /// The API URL (`http://host:port/api`).
    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// A request with the key set, for callers that handle the body themselves.
    pub(crate) fn raw(&self, method: reqwest::Method, url: &str) -> reqwest::RequestBuilder {
        self.http.request(method, url).bearer_auth(&self.key)
    }

    /// A toolbox call on a sandbox, through the proxy URL the sandbox reports.
    pub(crate) async fn toolbox(
        &self,
        sandbox: &Value,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> anyhow::Result<Value> {
        let base = sandbox["toolboxProxyUrl"]
            .as_str()
            .context("sandbox has no toolboxProxyUrl")?;
        let id = sandbox["id"].as_str().context("sandbox has no id")?;
        self.send(
            self.http
                .request(method, format!("{base}/{id}{path}"))
                .json(&body),
        )
        .await
    }
}
