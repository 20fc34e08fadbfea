//! Helpers shared by the gds integration tests and the GPU bench (which
//! includes this folder with `#[path]`). Each includer uses only part of it.

#![allow(dead_code)]

pub mod diag;
pub mod golden;
