//! The Identity and Node services as kubelet calls them, each call logged once here with its
//! outcome, and each failure answered with the gRPC code the CSI spec gives it.

use crate::proto::identity_server::{Identity, IdentityServer};
use crate::proto::node_server::{Node, NodeServer};
use crate::proto::*;
use crate::table::{Host, PublishError, Table};
use crate::volume::{Volume, VolumeError};
use std::path::Path;
use tonic::{Request, Response, Status};
use tracing::{Instrument, info_span, warn};

/// The driver's name, as the `CSIDriver` object and every PersistentVolume's `driver` give it.
pub const DRIVER_NAME: &str = "csi.strata.io";

/// The node plugin: its node's name for Kubernetes, and the volumes it has published.
#[derive(Debug, Clone)]
pub struct CsiNode {
    node_id: String,
    table: Table,
}

impl CsiNode {
    pub fn new(node_id: String, host: Host) -> CsiNode {
        CsiNode { node_id, table: Table::new(host) }
    }

    /// Publishes again what was published before a restart (see [`Table::restore`]).
    pub async fn restore(&self) {
        self.table.restore().await;
    }

    pub fn into_servers(self) -> (IdentityServer<CsiNode>, NodeServer<CsiNode>) {
        (IdentityServer::new(self.clone()), NodeServer::new(self))
    }
}

impl From<VolumeError> for Status {
    fn from(e: VolumeError) -> Status {
        Status::invalid_argument(e.to_string())
    }
}

impl From<PublishError> for Status {
    fn from(e: PublishError) -> Status {
        let text = e.to_string();
        match e {
            PublishError::Conflict { .. } => Status::already_exists(text),
            PublishError::Busy(_) | PublishError::OtherVolume { .. } => Status::failed_precondition(text),
            PublishError::Denied(_) => Status::permission_denied(text),
            PublishError::Source(_) => Status::unavailable(text),
            PublishError::Io { .. } => Status::internal(text),
        }
    }
}

#[tonic::async_trait]
impl Identity for CsiNode {
    async fn get_plugin_info(
        &self,
        _: Request<GetPluginInfoRequest>,
    ) -> Result<Response<GetPluginInfoResponse>, Status> {
        Ok(Response::new(GetPluginInfoResponse {
            name: DRIVER_NAME.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<GetPluginCapabilitiesRequest>,
    ) -> Result<Response<GetPluginCapabilitiesResponse>, Status> {
        // A node plugin only: volumes are static or inline, so there is no controller to call.
        Ok(Response::new(GetPluginCapabilitiesResponse { capabilities: vec![] }))
    }

    async fn probe(&self, _: Request<ProbeRequest>) -> Result<Response<ProbeResponse>, Status> {
        // Serving the socket means the daemon's cache and store are up: they open before it.
        Ok(Response::new(ProbeResponse { ready: Some(BoolValue { value: true }) }))
    }
}

#[tonic::async_trait]
impl Node for CsiNode {
    async fn node_publish_volume(
        &self,
        req: Request<NodePublishVolumeRequest>,
    ) -> Result<Response<NodePublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let span = info_span!("csi_publish", volume = %req.volume_id, target = %req.target_path);
        async {
            let volume = Volume::from_request(&req).inspect_err(|e| warn!(error = %e, "publish refused"))?;
            self.table.publish(volume).await.inspect_err(|e| warn!(error = %e, "publish failed"))?;
            Ok(Response::new(NodePublishVolumeResponse {}))
        }
        .instrument(span)
        .await
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<NodeUnpublishVolumeRequest>,
    ) -> Result<Response<NodeUnpublishVolumeResponse>, Status> {
        let req = req.into_inner();
        let span = info_span!("csi_unpublish", volume = %req.volume_id, target = %req.target_path);
        async {
            if req.volume_id.is_empty() || req.target_path.is_empty() {
                return Err(Status::invalid_argument("volume_id and target_path are required"));
            }
            self.table
                .unpublish(&req.volume_id, Path::new(&req.target_path))
                .await
                .inspect_err(|e| warn!(error = %e, "unpublish failed"))?;
            Ok(Response::new(NodeUnpublishVolumeResponse {}))
        }
        .instrument(span)
        .await
    }

    async fn node_get_capabilities(
        &self,
        _: Request<NodeGetCapabilitiesRequest>,
    ) -> Result<Response<NodeGetCapabilitiesResponse>, Status> {
        // No stage step: a volume is mounted once per pod, at its target, on the shared cache.
        Ok(Response::new(NodeGetCapabilitiesResponse { capabilities: vec![] }))
    }

    async fn node_get_info(&self, _: Request<NodeGetInfoRequest>) -> Result<Response<NodeGetInfoResponse>, Status> {
        Ok(Response::new(NodeGetInfoResponse {
            node_id: self.node_id.clone(),
            max_volumes_per_node: 0,
            accessible_topology: None,
        }))
    }
}
