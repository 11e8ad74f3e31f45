//! Answers for paths cove does not serve: 501 for Daytona operations it has not
//! implemented yet, 404 for paths that exist nowhere.

use axum::http::{Method, StatusCode, Uri};

use crate::ApiError;

/// Daytona's control API operations, from its OpenAPI document.
const DAYTONA_OPERATIONS: &str = include_str!("daytona_paths.txt");

fn matches_template(template: &str, path: &str) -> bool {
    let template: Vec<&str> = template.trim_matches('/').split('/').collect();
    let path: Vec<&str> = path.trim_matches('/').split('/').collect();
    template.len() == path.len()
        && template
            .iter()
            .zip(&path)
            .all(|(t, p)| (t.starts_with('{') && t.ends_with('}') && !p.is_empty()) || t == p)
}

/// The Daytona operation `method path` names, if any, as "METHOD /template".
pub(crate) fn daytona_operation(method: &Method, path: &str) -> Option<&'static str> {
    DAYTONA_OPERATIONS
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            line.split_once(' ').is_some_and(|(m, template)| {
                m == method.as_str() && matches_template(template, path)
            })
        })
}

pub(crate) async fn fallback(method: Method, uri: Uri) -> ApiError {
    match daytona_operation(&method, uri.path()) {
        Some(operation) => ApiError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{operation} is not implemented by cove yet"),
        ),
        None => ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no such endpoint: {method} /api{}", uri.path()),
        ),
    }
}

/// [`fallback`] for a Daytona path routed outside the `/api` router (whose
/// request path still starts with `/api`).
pub(crate) async fn outside_api(method: Method, uri: Uri) -> ApiError {
    let path = uri.path().strip_prefix("/api").unwrap_or(uri.path());
    let uri = path.parse().unwrap_or(uri);
    fallback(method, uri).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_operations_are_named() {
        assert_eq!(
            daytona_operation(&Method::POST, "/sandbox/abc/pause"),
            Some("POST /sandbox/{sandboxIdOrName}/pause")
        );
        assert_eq!(
            daytona_operation(&Method::GET, "/sandbox/abc/nonsense"),
            None
        );
        assert_eq!(
            daytona_operation(&Method::GET, "/snapshots"),
            Some("GET /snapshots")
        );
    }
}
