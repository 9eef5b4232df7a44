//! Writing to stdout. A command's output is often read by the next program in a pipe
//! (`boxery get vms | head -1`); when that reader leaves, the write fails with `EPIPE` and the
//! command ends quietly, as a Unix filter killed by `SIGPIPE` does (exit 141, nothing on
//! stderr), instead of panicking as `println!` would.

use std::fmt;
use std::io::{self, Write};

use crate::exit::{CliError, CliResult, Code};

/// Writes to stdout; `?` in the calling command. A closed pipe becomes [`Code::PipeClosed`].
pub fn write(args: fmt::Arguments<'_>, newline: bool) -> CliResult {
    let mut out = io::stdout().lock();
    let done = out
        .write_fmt(args)
        .and_then(|()| {
            if newline {
                out.write_all(b"\n")
            } else {
                Ok(())
            }
        })
        .and_then(|()| out.flush());
    done.map_err(CliError::from)
}

/// Whether an error is stdout's reader having left (anywhere in its chain).
pub fn is_closed_pipe(e: &CliError) -> bool {
    e.code == Code::PipeClosed
        || e.error.chain().any(|c| {
            let io = match c.downcast_ref::<boxery_verbs::VerbError>() {
                Some(boxery_verbs::VerbError::Io(e)) => Some(e),
                _ => c.downcast_ref::<io::Error>(),
            };
            io.is_some_and(|e| e.kind() == io::ErrorKind::BrokenPipe)
        })
}

/// `println!` to stdout, returning from the command on a write error.
macro_rules! outln {
    ($($arg:tt)*) => { $crate::out::write(format_args!($($arg)*), true)? };
}

/// `print!` to stdout, returning from the command on a write error.
macro_rules! out {
    ($($arg:tt)*) => { $crate::out::write(format_args!($($arg)*), false)? };
}

pub(crate) use {out, outln};
