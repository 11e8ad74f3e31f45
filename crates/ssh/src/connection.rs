//! One client connection: the SSH access token is the user name, checked once
//! at authentication; the sandbox it opens is then fixed for the connection.
//!
//! Like Daytona's gateway, the `none` method is what admits a client (OpenSSH
//! always tries it first, so `ssh TOKEN@host` needs no key or password);
//! passwords and keys prove nothing here and are refused. A refused token is
//! still let through authentication and the connection is then closed with a
//! disconnect message that says why: that message is the only text an SSH
//! client shows from the server before it is in. Such a connection holds no
//! sandbox, so it can open nothing in the meantime.

use std::net::SocketAddr;

use cove_engine::{Engine, ErrorKind, SandboxState};
use russh::server::{Auth, ChannelOpenHandle, Msg, Session};
use russh::{Channel, ChannelOpenFailure, Disconnect};

use crate::session::{self, error_chain, Target};

pub struct Connection {
    engine: Engine,
    peer: Option<SocketAddr>,
    /// The sandbox a valid token opens.
    sandbox_id: Option<String>,
    /// Why the token was refused, told to the client at disconnect.
    refusal: Option<String>,
}

impl Connection {
    pub fn new(engine: Engine, peer: Option<SocketAddr>) -> Connection {
        Connection {
            engine,
            peer,
            sandbox_id: None,
            refusal: None,
        }
    }

    /// The sandbox `token` opens, or why it does not.
    async fn admit(&self, token: &str) -> Result<String, String> {
        let internal = |error: cove_engine::EngineError| {
            tracing::error!(error = %error_chain(&error), "checking an ssh access token");
            "cove could not check the SSH access token; try again".to_owned()
        };
        let sandbox_id = self
            .engine
            .validate_ssh_access(token)
            .await
            .map_err(internal)?
            .ok_or_else(|| {
                "the SSH access token is unknown, expired or revoked; issue a new one \
                 (POST /api/sandbox/{id}/ssh-access)"
                    .to_owned()
            })?;
        let sandbox = match self.engine.get(&sandbox_id).await {
            Ok(sandbox) => sandbox,
            Err(error) if error.kind() == ErrorKind::NotFound => {
                return Err(format!("sandbox {sandbox_id} no longer exists"))
            }
            Err(error) => return Err(internal(error)),
        };
        if sandbox.state != SandboxState::Started {
            return Err(format!(
                "sandbox {} is {}; start it before connecting",
                sandbox.id, sandbox.state
            ));
        }
        Ok(sandbox.id)
    }

    fn target(&self, session: &Session) -> Option<Target> {
        Some(Target {
            engine: self.engine.clone(),
            sandbox_id: self.sandbox_id.clone()?,
            handle: session.handle(),
        })
    }
}

/// Loopback names a forward may target: the tunnel reaches 127.0.0.1 inside
/// the sandbox, nothing else.
fn is_sandbox_loopback(host: &str) -> bool {
    matches!(
        host,
        "localhost" | "127.0.0.1" | "::1" | "[::1]" | "0.0.0.0"
    )
}

impl russh::server::Handler for Connection {
    type Error = russh::Error;

    async fn auth_none(&mut self, user: &str) -> Result<Auth, Self::Error> {
        match self.admit(user).await {
            Ok(sandbox_id) => {
                tracing::info!(sandbox = %sandbox_id, peer = ?self.peer, "ssh connection admitted");
                self.sandbox_id = Some(sandbox_id);
            }
            Err(reason) => {
                tracing::debug!(peer = ?self.peer, %reason, "ssh connection refused");
                self.refusal = Some(reason);
            }
        }
        Ok(Auth::Accept)
    }

    async fn auth_succeeded(&mut self, session: &mut Session) -> Result<(), Self::Error> {
        if let Some(reason) = &self.refusal {
            session.disconnect(Disconnect::NoMoreAuthMethodsAvailable, reason, "en")?;
        }
        Ok(())
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(target) = self.target(session) else {
            reply
                .reject(ChannelOpenFailure::AdministrativelyProhibited)
                .await;
            return Ok(());
        };
        reply.accept().await;
        tokio::spawn(session::serve(channel, target));
        Ok(())
    }

    async fn channel_open_direct_tcpip(
        &mut self,
        channel: Channel<Msg>,
        host_to_connect: &str,
        port_to_connect: u32,
        _originator_address: &str,
        _originator_port: u32,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let Some(target) = self.target(session) else {
            reply
                .reject(ChannelOpenFailure::AdministrativelyProhibited)
                .await;
            return Ok(());
        };
        let refuse = |reason: String| ChannelOpenFailure::Other {
            code: 2, // SSH_OPEN_CONNECT_FAILED
            reason,
        };
        let Ok(port) = u16::try_from(port_to_connect) else {
            reply
                .reject(refuse(format!("invalid port {port_to_connect}")))
                .await;
            return Ok(());
        };
        if !is_sandbox_loopback(host_to_connect) {
            reply
                .reject(refuse(format!(
                    "only ports on the sandbox's own loopback can be forwarded (localhost:{port}), not {host_to_connect}"
                )))
                .await;
            return Ok(());
        }
        // The tunnel is opened in a task of its own: the connection must keep
        // reading while the agent answers.
        tokio::spawn(async move {
            let agent = match target.engine.toolbox(&target.sandbox_id).await {
                Ok((_, cove_runtime::AgentEndpoint::Unix(socket))) => {
                    crate::agent::Agent::new(socket)
                }
                Err(error) => return reply.reject(refuse(error.to_string())).await,
            };
            let mut tunnel = match agent.tunnel(port).await {
                Ok(tunnel) => tunnel,
                Err(error) => return reply.reject(refuse(error_chain(&error))).await,
            };
            reply.accept().await;
            let mut stream = channel.into_stream();
            if let Err(error) = tokio::io::copy_bidirectional(&mut stream, &mut tunnel).await {
                tracing::debug!(%error, port, "ssh port forward ended");
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::is_sandbox_loopback;

    #[test]
    fn only_loopback_is_forwarded() {
        assert!(is_sandbox_loopback("localhost"));
        assert!(is_sandbox_loopback("127.0.0.1"));
        assert!(!is_sandbox_loopback("10.0.0.1"));
        assert!(!is_sandbox_loopback("example.com"));
    }
}
