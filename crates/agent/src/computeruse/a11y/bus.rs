//! The accessibility bus: finding it through the desktop's session bus and
//! the AT-SPI calls the walk and the node operations make on it.
//!
//! Every call has its own deadline ([`CALL_TIMEOUT`]): what answers on this
//! bus are the sandbox's applications, which may never answer. A connection
//! lives for one request; nothing an application did to it outlasts that.

use std::time::Duration;

use zbus::names::BusName;
use zbus::zvariant::{DynamicDeserialize, DynamicType, OwnedObjectPath, OwnedValue, Value};
use zbus::Connection;

use super::node::{Bounds, NodeId};
use super::A11yError;

/// How long one call may take before its application counts as hung.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// `GetAddress` may start `at-spi-bus-launcher`, which starts a bus.
const ADDRESS_TIMEOUT: Duration = Duration::from_secs(10);
/// Messages from the bus kept unread at once (zbus's default is 64): a
/// peer may send this connection what it likes, and each message may be
/// as large as D-Bus allows.
const MAX_QUEUED: usize = 8;

const REGISTRY: &str = "org.a11y.atspi.Registry";
const ROOT_PATH: &str = "/org/a11y/atspi/accessible/root";
const ACCESSIBLE: &str = "org.a11y.atspi.Accessible";
const COMPONENT: &str = "org.a11y.atspi.Component";
const ACTION: &str = "org.a11y.atspi.Action";
const EDITABLE_TEXT: &str = "org.a11y.atspi.EditableText";
const VALUE: &str = "org.a11y.atspi.Value";
const PROPERTIES: &str = "org.freedesktop.DBus.Properties";
/// `CoordType.SCREEN`.
const SCREEN: u32 = 0;

/// What a failed call means for the caller.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    /// No such connection or object (it went away, or never was).
    #[error("{0}")]
    Gone(String),
    /// The object does not implement the interface, method or property.
    #[error("{0}")]
    Unsupported(String),
    #[error("no answer within {}s", .0.as_secs())]
    Timeout(Duration),
    #[error(transparent)]
    Other(Box<zbus::Error>),
}

impl From<zbus::Error> for CallError {
    fn from(error: zbus::Error) -> Self {
        let zbus::Error::MethodError(name, message, _) = &error else {
            return Self::Other(Box::new(error));
        };
        let text = match message {
            Some(message) => format!("{name}: {message}"),
            None => name.to_string(),
        };
        match name.as_str() {
            "org.freedesktop.DBus.Error.ServiceUnknown"
            | "org.freedesktop.DBus.Error.NameHasNoOwner"
            | "org.freedesktop.DBus.Error.UnknownObject" => Self::Gone(text),
            "org.freedesktop.DBus.Error.UnknownMethod"
            | "org.freedesktop.DBus.Error.UnknownInterface"
            | "org.freedesktop.DBus.Error.UnknownProperty"
            | "org.freedesktop.DBus.Error.NotSupported"
            | "org.freedesktop.DBus.Error.InvalidArgs" => Self::Unsupported(text),
            _ => Self::Other(Box::new(error)),
        }
    }
}

/// A connection to the desktop's accessibility bus.
pub(crate) struct A11yBus {
    connection: Connection,
}

impl A11yBus {
    /// Asks the session bus at `session_bus` where the accessibility bus is
    /// (`org.a11y.Bus.GetAddress`, which starts it if need be) and connects.
    pub(crate) async fn connect(session_bus: &str) -> Result<Self, A11yError> {
        let unavailable = |why: String| A11yError::Unavailable(why);
        let session = timed(ADDRESS_TIMEOUT, connect_to(session_bus))
            .await
            .map_err(|e| unavailable(format!("the session bus {session_bus}: {e}")))?;
        let address: String = timed(
            ADDRESS_TIMEOUT,
            call(
                &session,
                "org.a11y.Bus",
                "/org/a11y/bus",
                "org.a11y.Bus",
                "GetAddress",
                &(),
            ),
        )
        .await
        .map_err(|e| unavailable(format!("org.a11y.Bus.GetAddress: {e}")))?;
        // The answer comes from whatever owns org.a11y.Bus; only a Unix
        // socket is a place an accessibility bus can be.
        if !address.starts_with("unix:") {
            return Err(unavailable(format!(
                "org.a11y.Bus gave {:?}, not a unix: address",
                super::node::clip(&address, 200)
            )));
        }
        let connection = timed(ADDRESS_TIMEOUT, connect_to(&address))
            .await
            .map_err(|e| unavailable(format!("the accessibility bus {address}: {e}")))?;
        Ok(Self { connection })
    }

    /// The desktop: the registry's root, whose children are the applications.
    pub(crate) fn desktop() -> NodeId {
        NodeId::new(REGISTRY, ROOT_PATH).expect("a valid name and path")
    }

    async fn call<B, R>(
        &self,
        node: &NodeId,
        interface: &str,
        method: &str,
        body: &B,
    ) -> Result<R, CallError>
    where
        B: serde::Serialize + DynamicType,
        R: for<'d> DynamicDeserialize<'d>,
    {
        timed(
            CALL_TIMEOUT,
            call(
                &self.connection,
                node.bus_name().as_str(),
                node.path().as_str(),
                interface,
                method,
                body,
            ),
        )
        .await
    }

    async fn property(
        &self,
        node: &NodeId,
        interface: &str,
        name: &str,
    ) -> Result<OwnedValue, CallError> {
        self.call(node, PROPERTIES, "Get", &(interface, name)).await
    }

    pub(crate) async fn children(&self, node: &NodeId) -> Result<Vec<NodeId>, CallError> {
        let refs: Vec<(String, OwnedObjectPath)> =
            self.call(node, ACCESSIBLE, "GetChildren", &()).await?;
        // A reference that is no bus name is the application's mistake, or
        // its trick: it names nothing this walk could ask.
        Ok(refs
            .iter()
            .filter_map(|(bus_name, path)| NodeId::new(bus_name, path.as_str()))
            .collect())
    }

    pub(crate) async fn role_name(&self, node: &NodeId) -> Result<String, CallError> {
        self.call(node, ACCESSIBLE, "GetRoleName", &()).await
    }

    pub(crate) async fn state(&self, node: &NodeId) -> Result<Vec<u32>, CallError> {
        self.call(node, ACCESSIBLE, "GetState", &()).await
    }

    pub(crate) async fn interfaces(&self, node: &NodeId) -> Result<Vec<String>, CallError> {
        self.call(node, ACCESSIBLE, "GetInterfaces", &()).await
    }

    /// `Accessible.Name` or `Accessible.Description`; empty when not a string.
    pub(crate) async fn text_property(
        &self,
        node: &NodeId,
        name: &str,
    ) -> Result<String, CallError> {
        let value = self.property(node, ACCESSIBLE, name).await?;
        Ok(match &*value {
            Value::Str(text) => text.as_str().to_owned(),
            _ => String::new(),
        })
    }

    pub(crate) async fn extents(&self, node: &NodeId) -> Result<Bounds, CallError> {
        let (x, y, width, height): (i32, i32, i32, i32) =
            self.call(node, COMPONENT, "GetExtents", &(SCREEN,)).await?;
        Ok(Bounds {
            x,
            y,
            width,
            height,
        })
    }

    /// The names of the node's actions, in order (`DoAction` takes the index).
    pub(crate) async fn action_names(&self, node: &NodeId) -> Result<Vec<String>, CallError> {
        let actions: Vec<(String, String, String)> =
            self.call(node, ACTION, "GetActions", &()).await?;
        Ok(actions.into_iter().map(|(name, _, _)| name).collect())
    }

    pub(crate) async fn do_action(&self, node: &NodeId, index: i32) -> Result<bool, CallError> {
        self.call(node, ACTION, "DoAction", &(index,)).await
    }

    pub(crate) async fn grab_focus(&self, node: &NodeId) -> Result<bool, CallError> {
        self.call(node, COMPONENT, "GrabFocus", &()).await
    }

    pub(crate) async fn set_text(&self, node: &NodeId, text: &str) -> Result<bool, CallError> {
        self.call(node, EDITABLE_TEXT, "SetTextContents", &(text,))
            .await
    }

    pub(crate) async fn set_current_value(
        &self,
        node: &NodeId,
        value: f64,
    ) -> Result<(), CallError> {
        self.call(
            node,
            PROPERTIES,
            "Set",
            &(VALUE, "CurrentValue", Value::from(value)),
        )
        .await
    }

    /// The process behind a bus connection, as the bus itself knows it
    /// (an application's `Application.Id` is the registry's number, no pid).
    pub(crate) async fn connection_pid(&self, bus_name: &BusName<'_>) -> Result<u32, CallError> {
        timed(
            CALL_TIMEOUT,
            call(
                &self.connection,
                "org.freedesktop.DBus",
                "/org/freedesktop/DBus",
                "org.freedesktop.DBus",
                "GetConnectionUnixProcessID",
                &(bus_name.as_str(),),
            ),
        )
        .await
    }
}

async fn connect_to(address: &str) -> Result<Connection, CallError> {
    Ok(zbus::connection::Builder::address(address)?
        .max_queued(MAX_QUEUED)
        .build()
        .await?)
}

async fn call<B, R>(
    connection: &Connection,
    destination: &str,
    path: &str,
    interface: &str,
    method: &str,
    body: &B,
) -> Result<R, CallError>
where
    B: serde::Serialize + DynamicType,
    R: for<'d> DynamicDeserialize<'d>,
{
    let reply = connection
        .call_method(Some(destination), path, Some(interface), method, body)
        .await?;
    Ok(reply.body().deserialize::<R>()?)
}

async fn timed<T>(
    limit: Duration,
    work: impl std::future::Future<Output = Result<T, CallError>>,
) -> Result<T, CallError> {
    tokio::time::timeout(limit, work)
        .await
        .unwrap_or(Err(CallError::Timeout(limit)))
}
