//! Listening TCP ports from `/proc/net/tcp` and `/proc/net/tcp6`, which show the
//! reader's own network namespace: the sandbox's.

use std::collections::BTreeSet;

use axum::extract::Path;
use serde::Serialize;

use crate::error::{ApiError, Json};

/// `st` column value of a listening socket (`TCP_LISTEN`).
const TCP_LISTEN: &str = "0A";

#[derive(Debug, Serialize)]
pub(super) struct PortList {
    ports: Vec<u16>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct PortInUse {
    is_in_use: bool,
}

pub(super) async fn list() -> Result<Json<PortList>, ApiError> {
    let ports = listening_ports().await?;
    Ok(Json(PortList {
        ports: ports.into_iter().collect(),
    }))
}

pub(super) async fn in_use(Path(port): Path<String>) -> Result<Json<PortInUse>, ApiError> {
    let port: u16 = port
        .parse()
        .ok()
        .filter(|port| *port != 0)
        .ok_or_else(|| ApiError::BadRequest(format!("invalid port: {port}")))?;
    let ports = listening_ports().await?;
    Ok(Json(PortInUse {
        is_in_use: ports.contains(&port),
    }))
}

async fn listening_ports() -> Result<BTreeSet<u16>, ApiError> {
    let mut ports = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match tokio::fs::read_to_string(table).await {
            Ok(text) => ports.extend(parse_listening(&text)),
            // A kernel without IPv6 has no tcp6 table.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(ApiError::internal("reading /proc/net/tcp", e)),
        }
    }
    Ok(ports)
}

/// Local ports of the listening sockets in one `/proc/net/tcp*` table.
fn parse_listening(table: &str) -> impl Iterator<Item = u16> + '_ {
    table.lines().skip(1).filter_map(|line| {
        let mut fields = line.split_whitespace();
        let local = fields.nth(1)?;
        let state = fields.nth(1)?;
        if state != TCP_LISTEN {
            return None;
        }
        let (_, port) = local.rsplit_once(':')?;
        u16::from_str_radix(port, 16).ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listening_sockets_count() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0\n\
   1: 0100007F:A3B2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 2 1 0000000000000000 20 4 30 10 -1\n";
        assert_eq!(parse_listening(table).collect::<Vec<_>>(), vec![8080]);
        let table6 = "  sl  local_address                         remote_address                        st\n\
   0: 00000000000000000000000000000000:0BB8 00000000000000000000000000000000:0000 0A 00000000:00000000\n";
        assert_eq!(parse_listening(table6).collect::<Vec<_>>(), vec![3000]);
    }
}
