//! Progress bars on a terminal (indicatif) for the engine's long work (`rewind_engine::progress`): one bar per piece
//! of work (a rank's load, a checkpoint write), removed when it ends. Off a terminal the engine logs plain lines.

use std::collections::HashMap;
use std::sync::Mutex;

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

/// Draws the engine's progress as bars on stderr; call once at start-up when stderr is a terminal.
pub fn install() {
    let multi = MultiProgress::new();
    let bars: Mutex<HashMap<String, ProgressBar>> = Mutex::new(HashMap::new());
    let style = ProgressStyle::with_template("{msg} [{bar:30}] {percent:>3}% {elapsed}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    rewind_engine::progress::set_reporter(Box::new(move |what, done, total| {
        let Ok(mut bars) = bars.lock() else { return };
        let bar = bars.entry(what.to_string()).or_insert_with(|| {
            let b = multi.add(ProgressBar::new(total));
            b.set_style(style.clone());
            b.set_message(what.to_string());
            b
        });
        bar.set_position(done);
        if done >= total {
            bar.finish_and_clear();
            bars.remove(what);
        }
    }));
}
