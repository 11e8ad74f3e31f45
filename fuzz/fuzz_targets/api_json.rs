//! Fuzz target `api_json`: every request body and query string the toolbox
//! API parses (`cove_agent::requests`), from arbitrary bytes, as the agent's
//! extractors do (`serde_json` for bodies, `serde_urlencoded` for queries).
//! Nothing may panic; a parse error is an answer like any other. The same
//! bytes go to code-run's chart side channel parser, which reads what a
//! user's program wrote.
//!
//! The control API's own bodies (create sandbox, volumes, snapshots) are
//! parsed in cove-api, whose dependencies (the engine, SQLite, object_store
//! with aws-lc) would triple this crate's build; see ARCHITECTURE.md.

#![no_main]

use cove_agent::requests::{bodies, queries};
use libfuzzer_sys::fuzz_target;

/// Parses `$data` into each type, dropping the result: only a panic counts.
macro_rules! parse_all {
    ($parse:path, $data:expr; $($ty:ty),+ $(,)?) => {
        $( let _: Result<$ty, _> = $parse($data); )+
    };
}

fuzz_target!(|data: &[u8]| {
    parse_all!(serde_json::from_slice, data;
        bodies::ExecuteRequest,
        bodies::CodeRunRequest,
        bodies::FindNodesRequest,
        bodies::InvokeNodeRequest,
        bodies::NodeRequest,
        bodies::SetNodeValueRequest,
        bodies::DownloadRequest,
        bodies::ReplaceRequest,
        bodies::BranchRequest,
        bodies::CheckoutRequest,
        bodies::AuthenticateRequest,
        bodies::SetRequest,
        bodies::UserRequest,
        bodies::AddRemoteRequest,
        bodies::CloneRequest,
        bodies::PullRequest,
        bodies::PushRequest,
        bodies::AddRequest,
        bodies::CommitRequest,
        bodies::InitRequest,
        bodies::ResetRequest,
        bodies::RestoreRequest,
        bodies::InterpreterExecuteRequest,
        bodies::CreateContextRequest,
        bodies::LspServerRequest,
        bodies::LspDocumentRequest,
        bodies::LspCompletionParams,
        bodies::PtyCreateRequest,
        bodies::PtyResizeRequest,
        bodies::CreateSessionRequest,
        bodies::SendInputRequest,
        bodies::SessionExecuteRequest,
        bodies::UpdateEnvRequest,
        bodies::GuestNetwork,
        bodies::IdentityRequest,
        bodies::GuestVolume,
    );
    parse_all!(serde_urlencoded::from_bytes, data;
        queries::A11yTreeQuery,
        queries::DownloadPathQuery,
        queries::ListQuery,
        queries::InfoPathQuery,
        queries::DeleteQuery,
        queries::FolderQuery,
        queries::PermissionsQuery,
        queries::MoveQuery,
        queries::PatternQuery,
        queries::UploadQuery,
        queries::WatchQuery,
        queries::GetQuery,
        queries::GitPathQuery,
        queries::LspDocumentQuery,
        queries::LspWorkspaceSymbolsQuery,
        queries::CreateConnectQuery,
        queries::LogsQuery,
        queries::UnpackQuery,
    );
    let _ = cove_agent::code_run::parse_charts(data);
});
