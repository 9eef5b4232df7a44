//! `metadata.managedFields` as the Kubernetes API serves them: the store keeps them in
//! Kubernetes' `ManagedFieldsEntry` shape (`boxery_store::fields`: manager, operation `Apply`
//! or `Update`, apiVersion, time, fieldsType `FieldsV1`, fieldsV1); an entry written before
//! those were kept gets the values every entry has. Clients never write them: a body's
//! `managedFields` are dropped (`resources::body_in`), as an apply's are.

use boxery_api::ManagedFieldsEntry;

/// Fill in what an older entry lacks: its `apiVersion` (boxery serves one), its `fieldsType`
/// (`FieldsV1`, the only one) and an empty `fieldsV1`.
pub fn complete(entries: &mut [ManagedFieldsEntry]) {
    for e in entries {
        if e.api_version.is_empty() {
            e.api_version = crate::GROUP_VERSION.to_string();
        }
        if e.fields_type.is_empty() {
            e.fields_type = "FieldsV1".into();
        }
        if e.fields_v1.is_null() {
            e.fields_v1 = serde_json::Value::Object(Default::default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use boxery_api::ManagedFieldsOperation;

    #[test]
    fn an_old_entry_is_completed() {
        let mut e = vec![ManagedFieldsEntry {
            manager: "m".into(),
            operation: ManagedFieldsOperation::Update,
            api_version: String::new(),
            time: None,
            fields_type: String::new(),
            fields_v1: serde_json::Value::Null,
        }];
        complete(&mut e);
        let v = serde_json::to_value(&e[0]).unwrap();
        assert_eq!(v["apiVersion"], crate::GROUP_VERSION);
        assert_eq!(v["fieldsType"], "FieldsV1");
        assert_eq!(v["fieldsV1"], serde_json::json!({}));
        assert_eq!(v["operation"], "Update");
    }
}
