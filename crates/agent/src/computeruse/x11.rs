//! The agent's own connection to the desktop's X server: screenshots come
//! from `GetImage`, input goes in through XTest, the cursor from XFixes,
//! displays from RandR and windows from the window manager's EWMH hints.
//! One connection serves every request, so a call costs a round trip or
//! two, never a new process.
//!
//! Calls block; handlers run them on a blocking thread.

use std::collections::HashMap;
use std::sync::Mutex;

use x11rb::connection::{Connection as _, RequestConnection as _};
use x11rb::protocol::randr::ConnectionExt as _;
use x11rb::protocol::xfixes::ConnectionExt as _;
use x11rb::protocol::xproto::{
    self, Atom, AtomEnum, ConnectionExt as _, ImageFormat, Keycode, Keysym, Window,
};
use x11rb::protocol::xtest::ConnectionExt as _;
use x11rb::rust_connection::RustConnection;
use x11rb::wrapper::ConnectionExt as _;

use super::keys;

/// An X failure, as the text a caller can read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct XError(pub String);

fn failed(what: &'static str) -> impl Fn(&dyn std::fmt::Display) -> XError {
    move |error| XError(format!("{what}: {error}"))
}

macro_rules! x {
    ($what:literal, $call:expr) => {
        $call
            .map_err(|e| XError(format!(concat!($what, ": {}"), e)))?
            .reply()
            .map_err(|e| XError(format!(concat!($what, ": {}"), e)))?
    };
}

macro_rules! x_void {
    ($what:literal, $call:expr) => {
        $call.map_err(|e| XError(format!(concat!($what, ": {}"), e)))?
    };
}

/// Mouse buttons as X numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Button {
    Left = 1,
    Middle = 2,
    Right = 3,
    WheelUp = 4,
    WheelDown = 5,
    WheelLeft = 6,
    WheelRight = 7,
}

/// Pixels of a captured area, 8-bit RGB, row by row.
#[derive(Debug)]
pub struct Capture {
    pub width: u32,
    pub height: u32,
    pub rgb: Vec<u8>,
}

/// A display (a RandR monitor, or the whole screen without RandR).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Display {
    pub x: i32,
    pub y: i32,
    pub width: u32,
    pub height: u32,
    pub primary: bool,
}

/// A top-level window the window manager lists.
#[derive(Debug, Clone)]
pub struct WindowInfo {
    pub id: u32,
    pub title: String,
    pub x: i32,
    pub y: i32,
    pub width: u32,
    pub height: u32,
    pub active: bool,
}

/// Where a keysym is on the keyboard: its keycode, and whether Shift reaches it.
#[derive(Debug, Clone, Copy)]
struct KeyPlace {
    code: Keycode,
    shifted: bool,
}

struct Keymap {
    places: HashMap<Keysym, KeyPlace>,
    /// A keycode with no symbols, borrowed for symbols the keymap lacks.
    spare: Option<Keycode>,
    per_code: u8,
}

pub struct Screen {
    conn: RustConnection,
    root: Window,
    pub width: u16,
    pub height: u16,
    depth: u8,
    bits_per_pixel: u8,
    keymap: Mutex<Option<Keymap>>,
    has_xfixes: bool,
    has_randr: bool,
}

impl std::fmt::Debug for Screen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Screen")
            .field("width", &self.width)
            .field("height", &self.height)
            .finish()
    }
}

impl Screen {
    /// Connects to `display` (`:0`) and checks the extensions input needs.
    pub fn connect(display: &str) -> Result<Self, XError> {
        let (conn, screen) = RustConnection::connect(Some(display))
            .map_err(|e| failed("connect to the X server")(&e))?;
        let setup = conn.setup();
        let root_screen = &setup.roots[screen];
        let depth = root_screen.root_depth;
        let bits_per_pixel = setup
            .pixmap_formats
            .iter()
            .find(|f| f.depth == depth)
            .map(|f| f.bits_per_pixel)
            .unwrap_or(32);
        let (root, width, height) = (
            root_screen.root,
            root_screen.width_in_pixels,
            root_screen.height_in_pixels,
        );
        let has = |name: &'static str| conn.extension_information(name).ok().flatten().is_some();
        if !has(x11rb::protocol::xtest::X11_EXTENSION_NAME) {
            return Err(XError("the X server lacks the XTEST extension".into()));
        }
        let has_xfixes = has(x11rb::protocol::xfixes::X11_EXTENSION_NAME)
            && conn
                .xfixes_query_version(4, 0)
                .ok()
                .and_then(|c| c.reply().ok())
                .is_some();
        let has_randr = has(x11rb::protocol::randr::X11_EXTENSION_NAME)
            && conn
                .randr_query_version(1, 5)
                .ok()
                .and_then(|c| c.reply().ok())
                .is_some_and(|v| (v.major_version, v.minor_version) >= (1, 5));
        Ok(Self {
            conn,
            root,
            width,
            height,
            depth,
            bits_per_pixel,
            keymap: Mutex::new(None),
            has_xfixes,
            has_randr,
        })
    }

    /// Whether the connection still works (one round trip).
    pub fn alive(&self) -> bool {
        self.conn.sync().is_ok()
    }

    /// The pixels of a rectangle of the screen, with the cursor drawn in if asked.
    pub fn capture(
        &self,
        x: u16,
        y: u16,
        width: u16,
        height: u16,
        cursor: bool,
    ) -> Result<Capture, XError> {
        let reply = x!(
            "capture the screen",
            self.conn.get_image(
                ImageFormat::Z_PIXMAP,
                self.root,
                x as i16,
                y as i16,
                width,
                height,
                !0
            )
        );
        let pixels = usize::from(width) * usize::from(height);
        if self.depth < 24 || self.bits_per_pixel != 32 || reply.data.len() < pixels * 4 {
            return Err(XError(format!(
                "unsupported screen format: depth {}, {} bits per pixel",
                self.depth, self.bits_per_pixel
            )));
        }
        let mut rgb = Vec::with_capacity(pixels * 3);
        // Z_PIXMAP at 32 bits per pixel, least significant byte first: B, G, R, pad.
        for px in reply.data[..pixels * 4].chunks_exact(4) {
            rgb.extend_from_slice(&[px[2], px[1], px[0]]);
        }
        let mut capture = Capture {
            width: width.into(),
            height: height.into(),
            rgb,
        };
        if cursor {
            self.draw_cursor(&mut capture, x.into(), y.into())?;
        }
        Ok(capture)
    }

    /// Blends the cursor's image (premultiplied ARGB from XFixes) into a
    /// capture whose top left is at (`left`, `top`) on the screen.
    fn draw_cursor(&self, capture: &mut Capture, left: i32, top: i32) -> Result<(), XError> {
        if !self.has_xfixes {
            return Ok(());
        }
        let cursor = x!("read the cursor", self.conn.xfixes_get_cursor_image());
        let origin_x = i32::from(cursor.x) - i32::from(cursor.xhot) - left;
        let origin_y = i32::from(cursor.y) - i32::from(cursor.yhot) - top;
        let (cw, ch) = (i32::from(cursor.width), i32::from(cursor.height));
        for cy in 0..ch {
            for cx in 0..cw {
                let (px, py) = (origin_x + cx, origin_y + cy);
                if px < 0 || py < 0 || px >= capture.width as i32 || py >= capture.height as i32 {
                    continue;
                }
                let Some(&argb) = cursor.cursor_image.get((cy * cw + cx) as usize) else {
                    continue;
                };
                let alpha = argb >> 24;
                if alpha == 0 {
                    continue;
                }
                let at = (py as usize * capture.width as usize + px as usize) * 3;
                for (i, shift) in [16u32, 8, 0].into_iter().enumerate() {
                    let source = (argb >> shift) & 0xff;
                    let dest = u32::from(capture.rgb[at + i]);
                    capture.rgb[at + i] = (source + dest * (255 - alpha) / 255).min(255) as u8;
                }
            }
        }
        Ok(())
    }

    pub fn pointer(&self) -> Result<(i32, i32), XError> {
        let reply = x!("read the pointer", self.conn.query_pointer(self.root));
        Ok((reply.root_x.into(), reply.root_y.into()))
    }

    /// Moves the pointer, without waiting for the server.
    fn motion(&self, x: i32, y: i32) -> Result<(), XError> {
        let (x, y) = (self.clamp_x(x), self.clamp_y(y));
        x_void!(
            "move the pointer",
            self.conn
                .xtest_fake_input(xproto::MOTION_NOTIFY_EVENT, 0, 0, self.root, x, y, 0)
        );
        Ok(())
    }

    fn clamp_x(&self, x: i32) -> i16 {
        x.clamp(0, i32::from(self.width) - 1) as i16
    }

    fn clamp_y(&self, y: i32) -> i16 {
        y.clamp(0, i32::from(self.height) - 1) as i16
    }

    /// Moves the pointer and waits until the server has done it.
    pub fn move_to(&self, x: i32, y: i32) -> Result<(), XError> {
        self.motion(x, y)?;
        self.sync()
    }

    /// A pointer move that the server has applied.
    pub fn sync(&self) -> Result<(), XError> {
        self.conn
            .sync()
            .map_err(|e| failed("reach the X server")(&e))
    }

    pub fn button(&self, button: Button, press: bool) -> Result<(), XError> {
        let kind = if press {
            xproto::BUTTON_PRESS_EVENT
        } else {
            xproto::BUTTON_RELEASE_EVENT
        };
        x_void!(
            "press a mouse button",
            self.conn
                .xtest_fake_input(kind, button as u8, 0, self.root, 0, 0, 0)
        );
        Ok(())
    }

    /// Presses or releases a key by keycode.
    fn key_code(&self, code: Keycode, press: bool) -> Result<(), XError> {
        let kind = if press {
            xproto::KEY_PRESS_EVENT
        } else {
            xproto::KEY_RELEASE_EVENT
        };
        x_void!(
            "press a key",
            self.conn
                .xtest_fake_input(kind, code, 0, self.root, 0, 0, 0)
        );
        Ok(())
    }

    fn load_keymap(&self) -> Result<Keymap, XError> {
        let setup = self.conn.setup();
        let (first, last) = (setup.min_keycode, setup.max_keycode);
        let reply = x!(
            "read the keyboard map",
            self.conn.get_keyboard_mapping(first, last - first + 1)
        );
        let per_code = reply.keysyms_per_keycode;
        let mut places = HashMap::new();
        let mut spare = None;
        for (i, syms) in reply
            .keysyms
            .chunks(usize::from(per_code.max(1)))
            .enumerate()
        {
            let code = first + i as u8;
            if syms.iter().all(|&s| s == 0) {
                // The highest empty keycode, as other tools choose, away from
                // the keys people press.
                spare = Some(code);
                continue;
            }
            for (level, &sym) in syms.iter().take(2).enumerate() {
                if sym != 0 {
                    places.entry(sym).or_insert(KeyPlace {
                        code,
                        shifted: level == 1,
                    });
                }
            }
        }
        Ok(Keymap {
            places,
            spare,
            per_code,
        })
    }

    /// Where `sym` is; `None` if no key has it.
    fn place(&self, sym: Keysym) -> Result<Option<KeyPlace>, XError> {
        let mut keymap = self.keymap.lock().unwrap();
        if keymap.is_none() {
            *keymap = Some(self.load_keymap()?);
        }
        Ok(keymap.as_ref().and_then(|k| k.places.get(&sym).copied()))
    }

    /// Presses (or releases) the key of `sym`, holding Shift where its level
    /// needs it. A symbol no key has is put on a spare keycode for the stroke,
    /// then taken off again.
    pub fn key(&self, sym: Keysym, press: bool) -> Result<(), XError> {
        if let Some(place) = self.place(sym)? {
            let shift = if place.shifted {
                self.place(keys::SHIFT)?.map(|p| p.code)
            } else {
                None
            };
            if press {
                if let Some(shift) = shift {
                    self.key_code(shift, true)?;
                }
                self.key_code(place.code, true)?;
            } else {
                self.key_code(place.code, false)?;
                if let Some(shift) = shift {
                    self.key_code(shift, false)?;
                }
            }
            return Ok(());
        }
        let (spare, per_code) = {
            let keymap = self.keymap.lock().unwrap();
            let keymap = keymap.as_ref().expect("loaded by place");
            (keymap.spare, keymap.per_code)
        };
        let spare =
            spare.ok_or_else(|| XError(format!("no free keycode to type the symbol {sym:#x}")))?;
        let symbols = vec![sym; usize::from(per_code.max(1))];
        x_void!(
            "map a symbol to a key",
            self.conn
                .change_keyboard_mapping(1, spare, per_code, &symbols)
        );
        self.sync()?;
        self.key_code(spare, true)?;
        self.key_code(spare, false)?;
        self.sync()?;
        let empty = vec![0; usize::from(per_code.max(1))];
        x_void!(
            "unmap a borrowed key",
            self.conn
                .change_keyboard_mapping(1, spare, per_code, &empty)
        );
        Ok(())
    }

    /// Types one symbol: press and release.
    pub fn stroke(&self, sym: Keysym) -> Result<(), XError> {
        if self.place(sym)?.is_none() {
            // `key` presses and releases a borrowed key in one go.
            return self.key(sym, true);
        }
        self.key(sym, true)?;
        self.key(sym, false)
    }

    /// The displays: RandR monitors, or the whole screen.
    pub fn displays(&self) -> Result<Vec<Display>, XError> {
        if self.has_randr {
            let reply = x!(
                "read the monitors",
                self.conn.randr_get_monitors(self.root, true)
            );
            let displays: Vec<Display> = reply
                .monitors
                .iter()
                .map(|m| Display {
                    x: m.x.into(),
                    y: m.y.into(),
                    width: m.width.into(),
                    height: m.height.into(),
                    primary: m.primary,
                })
                .collect();
            if !displays.is_empty() {
                return Ok(displays);
            }
        }
        Ok(vec![Display {
            x: 0,
            y: 0,
            width: self.width.into(),
            height: self.height.into(),
            primary: true,
        }])
    }

    fn atom(&self, name: &[u8]) -> Result<Atom, XError> {
        Ok(x!("intern an atom", self.conn.intern_atom(false, name)).atom)
    }

    fn windows_property(&self, window: Window, name: &[u8]) -> Result<Vec<u32>, XError> {
        let atom = self.atom(name)?;
        let reply = x!(
            "read a window property",
            self.conn
                .get_property(false, window, atom, AtomEnum::WINDOW, 0, 4096)
        );
        Ok(reply.value32().map(|v| v.collect()).unwrap_or_default())
    }

    fn title(&self, window: Window) -> Result<String, XError> {
        let utf8 = self.atom(b"UTF8_STRING")?;
        let net_name = self.atom(b"_NET_WM_NAME")?;
        // A title is the window owner's text: read at most 4 KiB of it.
        let reply = x!(
            "read a window title",
            self.conn
                .get_property(false, window, net_name, utf8, 0, 1024)
        );
        if !reply.value.is_empty() {
            return Ok(String::from_utf8_lossy(&reply.value).into_owned());
        }
        let reply = x!(
            "read a window title",
            self.conn
                .get_property(false, window, AtomEnum::WM_NAME, AtomEnum::ANY, 0, 1024)
        );
        Ok(String::from_utf8_lossy(&reply.value).into_owned())
    }

    /// The top-level windows the window manager lists (`_NET_CLIENT_LIST`),
    /// or, without one, the mapped children of the root.
    pub fn windows(&self) -> Result<Vec<WindowInfo>, XError> {
        let mut ids = self.windows_property(self.root, b"_NET_CLIENT_LIST")?;
        if ids.is_empty() {
            let tree = x!("list windows", self.conn.query_tree(self.root));
            for child in tree.children {
                // A window can go between listing and asking: skip it.
                let Ok(Ok(attributes)) = self.conn.get_window_attributes(child).map(|c| c.reply())
                else {
                    continue;
                };
                if attributes.map_state == xproto::MapState::VIEWABLE
                    && !attributes.override_redirect
                {
                    ids.push(child);
                }
            }
        }
        let active = self
            .windows_property(self.root, b"_NET_ACTIVE_WINDOW")?
            .first()
            .copied();
        let mut windows = Vec::with_capacity(ids.len());
        for id in ids {
            // A window can go between listing and asking: skip it.
            let Ok(Ok(geometry)) = self.conn.get_geometry(id).map(|c| c.reply()) else {
                continue;
            };
            let Ok(Ok(at)) = self
                .conn
                .translate_coordinates(id, self.root, 0, 0)
                .map(|c| c.reply())
            else {
                continue;
            };
            windows.push(WindowInfo {
                id,
                title: self.title(id).unwrap_or_default(),
                x: at.dst_x.into(),
                y: at.dst_y.into(),
                width: geometry.width.into(),
                height: geometry.height.into(),
                active: Some(id) == active,
            });
        }
        Ok(windows)
    }
}
