//! The agent inside a VM: the two boot stages ([`initramfs`] as the
//! initramfs's `/init`, [`boot`] as PID 1 on the root disk), the transport to
//! the host over virtio-serial ([`port`], [`session`]), and the endpoints the
//! host calls after a boot or a restore ([`setup`], which configures the NIC
//! with [`network`], mounts volumes with [`volumes`] and starts the sandbox
//! user's agent with [`user`]). In a container none of
//! this runs: the host builds the machine and hands the agent a socket.

pub mod boot;
pub mod initramfs;
pub mod network;
pub mod port;
pub mod session;
pub mod setup;
pub mod user;
pub mod volumes;
