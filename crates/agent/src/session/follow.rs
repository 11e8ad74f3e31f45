//! `logs?follow=true`: streams a command's output over a WebSocket, each
//! message prefixed with the stdout/stderr marker the SDK demultiplexes on,
//! and closes with 1000 once the command has ended.

use std::sync::Arc;

use axum::extract::ws::{CloseFrame, Message, WebSocket};

use super::CommandRecord;

pub(super) async fn stream(record: Arc<CommandRecord>, mut socket: WebSocket) {
    let mut changes = record.subscribe();
    let mut sent = 0;
    loop {
        let (chunks, finished) = record.chunks_since(sent);
        sent += chunks.len();
        for (stream, chunk) in chunks {
            let mut message = Vec::with_capacity(3 + chunk.len());
            message.extend_from_slice(stream.marker());
            message.extend_from_slice(&chunk);
            if socket.send(Message::Binary(message.into())).await.is_err() {
                return;
            }
        }
        if finished {
            break;
        }
        tokio::select! {
            _ = changes.changed() => {}
            // The client sends nothing; a close or error from it ends the stream.
            incoming = socket.recv() => match incoming {
                Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                Some(Ok(_)) => {}
            },
        }
    }
    let close = CloseFrame {
        code: 1000,
        reason: "command finished".into(),
    };
    let _ = socket.send(Message::Close(Some(close))).await;
}
