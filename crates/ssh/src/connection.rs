//! One client connection: the SSH access token is the user name, checked at
//! authentication and again at every channel the client opens, so a token
//! that was revoked or has expired opens nothing more; the sandbox it opened
//! stays fixed for the connection. (The gateway's connection task also
//! closes a live connection as soon as its token is revoked.)
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
use tokio::sync::{watch, OwnedSemaphorePermit};

use crate::session::{self, error_chain, Target};

/// Why a token opens no sandbox (now); the message is what the client is told.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("the SSH access token is unknown, expired or revoked; issue a new one (POST /api/sandbox/{{id}}/ssh-access)")]
    UnknownToken,
    /// A token that was admitted and no longer opens its sandbox.
    #[error("{}", TOKEN_GONE)]
    TokenGone,
    #[error("sandbox {id} no longer exists")]
    SandboxGone { id: String },
    #[error("sandbox {id} is {state}; start it before connecting")]
    NotStarted { id: String, state: SandboxState },
    /// The engine failed (logged where it happened).
    #[error("cove could not check the SSH access token; try again")]
    CheckFailed,
    #[error("not admitted")]
    NotAdmitted,
}

/// What a client that authenticated holds: its token and the sandbox it opens.
#[derive(Clone, Debug)]
pub(crate) struct Admitted {
    pub token: String,
    pub sandbox_id: String,
}

/// Told to a client whose token no longer opens its sandbox.
pub(crate) const TOKEN_GONE: &str =
    "the SSH access token was revoked or has expired; issue a new one \
     (POST /api/sandbox/{id}/ssh-access)";

pub(crate) struct Connection {
    engine: Engine,
    peer: Option<SocketAddr>,
    /// The token and sandbox of a client that was admitted.
    admitted: Option<Admitted>,
    /// Why the token was refused, told to the client at disconnect.
    refusal: Option<Refusal>,
    /// Tells the connection's task once the client is in.
    on_admitted: watch::Sender<Option<Admitted>>,
    /// The client's place among the unauthenticated; given up once it is in.
    unauthenticated: Option<OwnedSemaphorePermit>,
}

impl Connection {
    pub(crate) fn new(
        engine: Engine,
        peer: Option<SocketAddr>,
        on_admitted: watch::Sender<Option<Admitted>>,
        unauthenticated: OwnedSemaphorePermit,
    ) -> Connection {
        Connection {
            engine,
            peer,
            admitted: None,
            refusal: None,
            on_admitted,
            unauthenticated: Some(unauthenticated),
        }
    }

    /// The sandbox `token` opens, or why it does not.
    async fn admit(&self, token: &str) -> Result<String, Refusal> {
        let internal = |error: cove_engine::EngineError| {
            tracing::error!(error = %error_chain(&error), "checking an ssh access token");
            Refusal::CheckFailed
        };
        let sandbox_id = self
            .engine
            .access()
            .validate_ssh_access(token)
            .await
            .map_err(internal)?
            .ok_or(Refusal::UnknownToken)?;
        let sandbox = match self.engine.sandboxes().get(&sandbox_id).await {
            Ok(sandbox) => sandbox,
            Err(error) if error.kind() == ErrorKind::NotFound => {
                return Err(Refusal::SandboxGone { id: sandbox_id })
            }
            Err(error) => return Err(internal(error)),
        };
        if sandbox.state != SandboxState::Started {
            return Err(Refusal::NotStarted {
                id: sandbox.id,
                state: sandbox.state,
            });
        }
        Ok(sandbox.id)
    }

    /// Where a new channel goes, if the token still opens the sandbox: it is
    /// checked again for every channel, so a revoked or expired token opens
    /// nothing more. `Err` is the reason told to the client.
    async fn target(&self, handle: russh::server::Handle) -> Result<Target, Refusal> {
        let Some(admitted) = &self.admitted else {
            return Err(Refusal::NotAdmitted);
        };
        match self
            .engine
            .access()
            .validate_ssh_access(&admitted.token)
            .await
        {
            Ok(Some(sandbox_id)) if sandbox_id == admitted.sandbox_id => {}
            Ok(_) => return Err(Refusal::TokenGone),
            Err(error) => {
                tracing::error!(error = %error_chain(&error), "checking an ssh access token");
                return Err(Refusal::CheckFailed);
            }
        }
        Ok(Target {
            engine: self.engine.clone(),
            sandbox_id: admitted.sandbox_id.clone(),
            handle,
        })
    }

    /// Refuses a channel; a token that is gone also ends the connection.
    async fn refuse_channel(
        &self,
        reply: ChannelOpenHandle,
        refusal: Refusal,
        session: &mut Session,
    ) -> Result<(), russh::Error> {
        let reason = refusal.to_string();
        tracing::info!(peer = ?self.peer, %reason, "ssh channel refused");
        let gone = matches!(refusal, Refusal::TokenGone);
        reply
            .reject(ChannelOpenFailure::Other {
                code: 1, // SSH_OPEN_ADMINISTRATIVELY_PROHIBITED
                reason: reason.clone(),
            })
            .await;
        if gone {
            session.disconnect(Disconnect::ByApplication, &reason, "en")?;
        }
        Ok(())
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
                self.admitted = Some(Admitted {
                    token: user.to_owned(),
                    sandbox_id,
                });
            }
            Err(reason) => {
                tracing::debug!(peer = ?self.peer, %reason, "ssh connection refused");
                self.refusal = Some(reason);
            }
        }
        Ok(Auth::Accept)
    }

    async fn auth_succeeded(&mut self, session: &mut Session) -> Result<(), Self::Error> {
        if let Some(refusal) = &self.refusal {
            let reason = refusal.to_string();
            session.disconnect(Disconnect::NoMoreAuthMethodsAvailable, &reason, "en")?;
            return Ok(());
        }
        self.unauthenticated = None;
        self.on_admitted.send_replace(self.admitted.clone());
        Ok(())
    }

    async fn channel_open_session(
        &mut self,
        channel: Channel<Msg>,
        reply: ChannelOpenHandle,
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        let target = match self.target(session.handle()).await {
            Ok(target) => target,
            Err(reason) => return self.refuse_channel(reply, reason, session).await,
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
        let target = match self.target(session.handle()).await {
            Ok(target) => target,
            Err(reason) => return self.refuse_channel(reply, reason, session).await,
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
            let agent = match target.engine.sandboxes().toolbox(&target.sandbox_id).await {
                Ok((_, endpoint)) => crate::agent::Agent::new(target.sandbox_id.clone(), endpoint),
                Err(error) => return reply.reject(refuse(cove_engine::describe(&error))).await,
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
