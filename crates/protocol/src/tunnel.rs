//! `GET /cove/tunnel/{port}` (a cove extension): an HTTP/1.1 upgrade to a raw
//! TCP stream to 127.0.0.1:`port` inside the sandbox. The request carries
//! `Connection: Upgrade` and `Upgrade:` [`PROTOCOL`]; the agent answers 101
//! with the same name, or 502 with a JSON message when nothing listens.
//! Previews and SSH port forwarding use it.

/// The upgrade's name.
pub const PROTOCOL: &str = "cove-tcp";

/// The route, as the agent's router writes it.
pub const ROUTE: &str = "/cove/tunnel/{port}";

/// The path of a tunnel to `port`.
pub fn path(port: u16) -> String {
    format!("/cove/tunnel/{port}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_path_fills_the_route() {
        assert_eq!(super::path(8080), super::ROUTE.replace("{port}", "8080"));
    }
}
