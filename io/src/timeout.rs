//! Deadlines for futures on a glommio executor.

use std::future::Future;
use std::time::Duration;

/// Runs `fut` for at most `limit`: `Some` with its output, `None` when the
/// time ran out first (`fut` is then dropped). Must run inside a glommio
/// executor.
pub async fn with_timeout<T>(limit: Duration, fut: impl Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(fut.await) }, async {
        glommio::timer::sleep(limit).await;
        None
    })
    .await
}
