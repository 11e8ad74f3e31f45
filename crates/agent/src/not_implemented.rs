//! Answers for toolbox paths the agent does not serve: 501 naming the Daytona
//! operation when the path is one of Daytona's toolbox API (computer use,
//! for now), so an SDK call says what is missing; 404 for paths that
//! exist nowhere.

use axum::http::{Method, Uri};

use crate::error::ApiError;

/// Daytona's toolbox operations, from its OpenAPI document.
const TOOLBOX_OPERATIONS: &str = include_str!("toolbox_paths.txt");

/// The Daytona toolbox operation `method path` names, as "METHOD /template".
fn toolbox_operation(method: &Method, path: &str) -> Option<&'static str> {
    let wanted: Vec<&str> = path.trim_matches('/').split('/').collect();
    TOOLBOX_OPERATIONS
        .lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| {
            let Some((verb, template)) = line.split_once(' ') else {
                return false;
            };
            let parts: Vec<&str> = template.trim_matches('/').split('/').collect();
            verb == method.as_str()
                && parts.len() == wanted.len()
                && parts.iter().zip(&wanted).all(|(part, given)| {
                    part == given || (part.starts_with('{') && !given.is_empty())
                })
        })
}

pub async fn fallback(method: Method, uri: Uri) -> ApiError {
    match toolbox_operation(&method, uri.path()) {
        Some(operation) => ApiError::NotImplemented(operation.to_owned()),
        None => ApiError::NoRoute(uri.path().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daytona_operations_are_named() {
        assert_eq!(
            toolbox_operation(&Method::POST, "/computeruse/start"),
            Some("POST /computeruse/start")
        );
        assert_eq!(
            toolbox_operation(&Method::GET, "/computeruse/process/xfce4/logs"),
            Some("GET /computeruse/process/{processName}/logs")
        );
        assert_eq!(
            toolbox_operation(&Method::GET, "/computeruse/a11y/tree"),
            Some("GET /computeruse/a11y/tree")
        );
        assert_eq!(toolbox_operation(&Method::GET, "/nonsense"), None);
        assert_eq!(
            toolbox_operation(&Method::DELETE, "/computeruse/a11y/tree"),
            None
        );
    }
}
