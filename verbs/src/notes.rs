//! Notes the verbs have for the person running them (a home made private, an object left
//! behind by a force-delete): the verbs never print, so the front end says where they go
//! ([`set_sink`]: the CLI writes them on stderr); without a sink they go to the log.

use std::sync::OnceLock;

static SINK: OnceLock<fn(&str)> = OnceLock::new();

/// Where this process's notes go, set once by the front end (later calls are ignored).
pub fn set_sink(sink: fn(&str)) {
    let _ = SINK.set(sink);
}

/// Say `line` to the person running this process.
pub fn say(line: &str) {
    match SINK.get() {
        Some(sink) => sink(line),
        None => tracing::warn!("{line}"),
    }
}
