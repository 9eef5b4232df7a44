//! The fake backend (stub; see the issue for what it must do).
#![allow(missing_docs)]
use std::path::PathBuf;

#[derive(Debug)]
pub struct FakeBackend { pub dir: PathBuf }
impl FakeBackend { pub fn new(dir: PathBuf) -> Self { FakeBackend { dir } } }
